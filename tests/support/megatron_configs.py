"""Real Megatron-LM GPT configurations (tests/data/megatron_configs/, flags as written upstream, each
file naming its source) made runnable here by shrinking sizes only: placeholders point at local
files, model and batch sizes become tiny, iteration counts short. Parallel sizes, schedules, model
and operational flags stay as written."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from support.paths import REPO

CONFIGS = REPO / "tests" / "data" / "megatron_configs"
# the sizes a CPU runs in seconds: width, heads, sequence, batch, iterations (and the schedule lengths in them)
SHRINK = {"--num-layers": "8", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128",
          "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "64", "--max-position-embeddings": "64",
          "--micro-batch-size": "1", "--global-batch-size": "8", "--train-iters": "8", "--eval-interval": "4",
          "--eval-iters": "1", "--save-interval": "4", "--vocab-size": "1024", "--train-samples": "64",
          "--lr-decay-samples": "56", "--lr-warmup-samples": "8", "--lr-decay-iters": "8", "--exit-interval": "8",
          "--exit-duration-in-mins": "30", "--expert-model-parallel-size": "2", "--lr-warmup-iters": "2"}
# the example scripts' shell variables (their own defaults, sizes shrunk as above)
SCRIPT_VARS = {"NUM_LAYERS": "8", "SEQ_LENGTH": "64", "MAX_POSITION_EMBEDDINGS": "64", "MICRO_BATCH_SIZE": "1",
               "GLOBAL_BATCH_SIZE": "8", "TP_SIZE": "1", "CP_SIZE": "1", "PP_SIZE": "1"}


# values that Megatron-LM's own parser refuses as stored (its --distributed-backend choices are nccl
# and gloo): mended to what the config means, nothing else
UPSTREAM_MENDS = {"nccl2": "nccl"}
# a CPU has no transformer-engine: its configs run with megatron-core's local layers here (the same
# model; tests/gpu/ is where they run as written)
CPU_MENDS = {("--transformer-impl", "transformer_engine"): "local"}


# config -> what its refusal names (None: accepted)
OUTCOME = {
    "gpt3_7b_tp1_pp4_memory_speed": None,
    "gpt3_mcore_te_tp1_pp1_uniform_full_recompute": None,
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_disable_bias_linear": None,
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_swiglu": None,
    "gpt3_mcore_te_tp1_pp4_resume_torch_dist_untie_embeddings_and_outputs": None,
    "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer": None,
    "gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline": None,
    "gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion": None,
    "gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode": None,
    "gpt3_mcore_te_tp2_pp2_cp2": "--context-parallel-size 2: not supported by megatron-het. Fix: context "
                                 "parallelism lands with #38",
    # expert biases at expert-TP 2 (its TP): megatron-core 0.19 refuses them too (transformer_config.py:2279)
    "gpt3_345m_nightly_tp2_pp2_ep2_te_4experts2parallel": "--num-experts with linear biases: megatron-core trains "
                                                          "expert biases only with expert parallelism and expert-TP 1",
    "example_mixtral_8x7b_distributed": None,
    "example_gpt3_175b_distributed": "--rampup-batch-size [16, 16, 5859375]: not supported",
    "gpt3_15b_8t_release": "--rampup-batch-size: expected 3 arguments",  # one quoted string upstream
    "example_llama3_8b_h100_fp8": "--fp8-format hybrid: not supported",
    "gpt3_345m_weekly_h100_tp2_pp2_fp8_tp_pp_sp": "--fp8-format hybrid: not supported",
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_rope_embeddings_interleaved_no_fusion": None,
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_decoupled_lr": None,
    "gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split": "--account-for-embedding-in-pipeline-"
                                                                              "split True: not supported",
    "gpt3_345m_nightly_tp1_pp4_vp1_overlap_grad_reduce": "unrecognized arguments: --use-legacy-models",
}


def names() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def source(name: str) -> str:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["source"]


def argv(name: str, *, root: Path, bpe: tuple[str, str, str], sentencepiece: tuple[str, str]) -> list[str]:
    """The config's flags with sizes shrunk and placeholders pointed under ``root`` and at the data:
    ``bpe`` (dataset prefix, vocab.json, merges.txt) for GPT-2 BPE configs, ``sentencepiece``
    (dataset prefix, tokenizer model) for those that name a --tokenizer-model."""
    raw = [str(a) for a in yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["args"]]
    data_prefix, vocab, merges = bpe
    if "--tokenizer-model" in raw:
        data_prefix = sentencepiece[0]
    places = {"CHECKPOINT": str(root / "ckpt"), "TENSORBOARD": str(root / "tb"), "DATA_CACHE": str(root / "cache")}

    def place(value: str) -> str:
        if "TOKENIZER_MODEL" in value:
            return sentencepiece[1]
        for key, path in places.items():
            if key in value:
                return path
        if value.endswith("vocab.json") or "VOCAB_FILE" in value:
            return vocab
        if value.endswith("merges.txt") or "MERGE_FILE" in value:
            return merges
        if "DATA_PATH" in value or "DATA_BLEND" in value:
            return data_prefix
        return re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: SCRIPT_VARS.get(m.group(1), m.group(0)), value)

    out: list[str] = []
    i = 0
    while i < len(raw):
        flag = raw[i]
        values = []
        i += 1
        while i < len(raw) and not raw[i].startswith("--"):
            values.append(raw[i])
            i += 1
        if flag in SHRINK and values:
            values = [SHRINK[flag]]
        values = [CPU_MENDS.get((flag, v), UPSTREAM_MENDS.get(v, v)) for v in values]
        out += [flag, *(place(v) for v in values)]
    return out
