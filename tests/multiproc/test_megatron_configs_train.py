"""#35 acceptance: the real Megatron-LM configurations pretrain_gpt.py accepts
(tests/unit/cli/test_megatron_configs.py) train under torchrun as written upstream, sizes shrunk,
with only --hetero-cluster added, on real GPT-2-BPE-tokenized data: the run ends, and the loss of
the last iteration is below the first's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import megatron_configs
from support.bpe_files import bpe_files, corpus_head
from support.gpu_run import LOSS
from support.paths import REPO
from support.real_data import make_real_data

PRETRAIN = os.path.join(REPO, "pretrain_scripts/pretrain_gpt.py")
ACCEPTED = sorted(name for name, refusal in megatron_configs.OUTCOME.items() if refusal is None)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_het.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("megatron_configs")
    vocab, merges, _ = bpe_files(root)
    report = preprocess(PreprocessConfig(input=corpus_head(root, 2000), output_prefix=str(root / "gpt2"),
                                         append_eod=True, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                         merge_file=merges))
    (root / "sp").mkdir()
    return root, (report.prefixes["text"], str(vocab), str(merges)), make_real_data(root / "sp")


def _world(argv: list[str]) -> int:
    """TP x PP, times the replicas an expert domain needs (EP x expert-TP / TP; expert-TP defaults to TP)."""
    def size(flag: str, default: int = 1) -> int:
        return int(argv[argv.index(flag) + 1]) if flag in argv else default
    tp = size("--tensor-model-parallel-size")
    replicas = max(1, size("--expert-model-parallel-size") * size("--expert-tensor-parallel-size", tp) // tp)
    return tp * size("--pipeline-model-parallel-size") * replicas


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_megatron_config_trains(name, data, tmp_path):
    _, bpe, sentencepiece = data
    argv = megatron_configs.argv(name, root=tmp_path, bpe=bpe, sentencepiece=sentencepiece)
    world = _world(argv)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"islands:\n  - {{name: cpu, device: CPU, nodes: 1, gpus_per_node: {world}}}\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                           PRETRAIN, *argv, "--hetero-cluster", str(cluster)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{megatron_configs.source(name)}\n{out[-4000:]}"
    losses = [float(m.group(2)) for m in LOSS.finditer(proc.stdout)]
    log_interval = int(argv[argv.index("--log-interval") + 1]) if "--log-interval" in argv else 100
    assert len(losses) == 8 // log_interval and losses[-1] < losses[0], (name, losses)
