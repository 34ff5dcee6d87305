"""Export of the checkpoints pretrain_gpt.py writes (issue #34 item 5).

One gloo rank runs pretrain_gpt.py's own ``run`` (the planner chooses the plan, ``--hetero-plan auto``)
on the shipped corpus with its SentencePiece tokenizer, for a GPT (LayerNorm, learned positions, tied)
and a Llama-style model (RMSNorm, rotary, SwiGLU, GQA, untied), with a validation pass at the last
iteration and ``--save``. tools/checkpoint/convert.py's ``main`` then exports each checkpoint to hf and
megatron. Acceptance: transformers' AutoModelForCausalLM on the HF export gives the run's validation
loss on the run's validation batch within 2% (same tokens, fp32: measured within 1e-7). The megatron
export, loaded by megatron-core's own ``dist_checkpointing.load`` into a GPTModel, gives it too; and
the converter's het output of the HF export loads in the trainer (``pretrain_gpt.py --load``'s path) and
evaluates to it again. Then the Llama-style model trained by two ranks as one TP=2 stage (each holds
[gate_r; up_r] of the gated MLP) exports to the same loss (within the TP=2 run's reduction order).

Before the fix, the export failed on every SwiGLU checkpoint: the trainer stores a gated MLP's
``linear_fc1`` as its ``.gate`` and ``.up`` halves, and the converter asked for the fused tensor.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from support.paths import REPO
from support.real_data import make_real_data

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: everything is local
MODEL_FILE = os.path.join(REPO, "examples/models/tiny-cpu.yaml")
# One CPU rank: the planner's plan for it is one stage.
CLUSTER = "islands:\n  - {name: cpu, device: CPU, nodes: 1, gpus_per_node: 1}\n"
ITERS, GBS = 10, 8
# tiny-cpu.yaml (vocab 512 = the padded vocabulary at TP 1: no padding rows beyond HF's) with 2 layers
RECIPES = {
    "gpt": ["--num-layers", "2"],
    "llama": ["--num-layers", "2", "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
              "--num-query-groups", "2", "--ffn-hidden-size", "96"],
    # Llama-3's model flags as Megatron-LM's example spells them (#35 item 3): rotary base, wider heads,
    # another epsilon and init std reach megatron-core, the HF export and the Megatron export
    "llama3": ["--num-layers", "2", "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
               "--num-query-groups", "2", "--ffn-hidden-size", "96", "--rotary-base", "500000", "--kv-channels", "32",
               "--norm-epsilon", "1e-6", "--init-method-std", "0.0134", "--normalization", "RMSNorm",
               "--position-embedding-type", "rope", "--disable-bias-linear"],
}
ACCEPTANCE = 0.02  # issue #34: the HF export's loss within 2% of the run's validation loss
EXACT = 1e-4  # relative: the same tokens in fp32 through the same weights (measured <= 1e-7)
TP2_CLOSE = 1e-4  # relative, TP=2 run vs one-process HF: reduction order only (measured 4e-5)


def _argv(common: list[str], recipe: str, save: str) -> list[str]:
    return [*common, *RECIPES[recipe], "--save", save]


def export_worker(rank: int, world_size: int, common: list[str], out: str) -> dict:
    """Per recipe: pretrain_gpt.py's run, then convert.py het -> hf, het -> megatron and hf -> het, and
    the losses of the megatron export (megatron-core's load) and of the het re-import (the trainer's)."""
    from megatron_het.cli import convert as convert_cli
    from megatron_het.cli.pretrain import batch_fns, run
    from megatron_het.platform import detect_accelerator
    from megatron_het.runtime.arguments import parse_args

    results = {}
    for recipe in RECIPES:
        root = os.path.join(out, recipe)
        args = parse_args(_argv(common, recipe, os.path.join(root, "ckpt")))
        with contextlib.redirect_stdout(io.StringIO()):
            result = run(args, detect_accelerator())
        exits = {}
        for src, src_fmt, dst, dst_fmt in (("ckpt", "het", "hf", "hf"), ("ckpt", "het", "megatron", "megatron"),
                                           ("hf", "hf", "het-from-hf", "het")):
            exits[dst] = convert_cli.main(["--input", os.path.join(root, src), "--input-format", src_fmt,
                                           "--output", os.path.join(root, dst), "--output-format", dst_fmt,
                                           "--no-progress"])
        _, valid_fn = batch_fns(args)
        tokens = [valid_fn(i, range(GBS)) for i in range(args.loop.eval_iters)]  # the run's validation batches
        results[recipe] = {"validation": result.validation, "exits": exits, "tokens": tokens}
        if not any(exits.values()):
            results[recipe].update(megatron_loss=_megatron_core_loss(args.model, os.path.join(root, "megatron"), tokens),
                                   het_from_hf_loss=_trainer_loss(args, os.path.join(root, "het-from-hf"), valid_fn))
    return results


def _megatron_core_loss(model, save: str, tokens: list[torch.Tensor]) -> float:
    """Mean token loss of a megatron-core GPTModel that loaded the Megatron-LM export as Megatron-LM
    does: ``dist_checkpointing.load`` of the model's own ``sharded_state_dict``, then ``load_state_dict``."""
    from megatron.core import dist_checkpointing

    from megatron_het.checkpoint.convert import build_full_model, expected_shapes
    from megatron_het.checkpoint.convert.state import VOCAB_ROWS
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration

    path = iteration_dir(save, latest_iteration(save))
    padded = dist_checkpointing.load_common_state_dict(path)["args"].padded_vocab_size
    zeros = {n: torch.zeros((padded, *s[1:]) if n in VOCAB_ROWS else s) for n, s in expected_shapes(model).items()}
    gpt, pgc = build_full_model(model, padded, zeros)  # every weight zero until the load
    loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp})}, path)
    gpt.load_state_dict(loaded["model"])
    gpt.eval()
    losses = []
    with torch.no_grad():
        for batch in tokens:
            inputs, labels = batch[:, :-1], batch[:, 1:]
            positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
            losses.append(gpt(inputs, positions, None, labels=labels).float().mean().item())
    return sum(losses) / len(losses)


def _trainer_loss(args, save: str, valid_fn) -> float:
    """The validation loss of a one-rank trainer that loaded ``save`` as ``pretrain_gpt.py --load`` does."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration
    from megatron_het.plan import homogeneous_plan
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=args.model.num_layers,
                            micro_batch_size=args.train.micro_batch_size, global_batch_size=GBS)
    trainer = HeteroTrainer(model=args.model, plan=plan, train=args.train, batch_fn=valid_fn)
    try:
        trainer.load_checkpoint(iteration_dir(save, latest_iteration(save)), with_optimizer=False)
        return sum(trainer.evaluate(valid_fn, i) for i in range(args.loop.eval_iters)) / args.loop.eval_iters
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """pretrain_gpt.py's flags of every run but cluster and plan: the shipped corpus, tokenized as
    `make demo` does, with a validation split."""
    root = tmp_path_factory.mktemp("data")
    prefix, tokenizer = make_real_data(root)
    return ["--hetero-model", MODEL_FILE, "--micro-batch-size", "2", "--global-batch-size", str(GBS),
            "--train-iters", str(ITERS), "--lr", "1e-2", "--eval-interval", str(ITERS), "--eval-iters", "1",
            "--data-path", prefix, "--tokenizer-model", tokenizer, "--split", "90,10,0",
            "--data-cache-path", str(root / "cache")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data):
    from megatron_het.platform.local_launch import run_local

    out = tmp_path_factory.mktemp("export")
    cluster = out / "one-cpu.yaml"
    cluster.write_text(CLUSTER)
    common = [*data, "--hetero-cluster", str(cluster), "--hetero-plan", "auto"]
    return out, run_local(1, export_worker, (common, str(out)), timeout_s=600)[0]


def _hf_loss(path, tokens: list[torch.Tensor]) -> float:
    import transformers  # a test dependency (scripts/bootstrap_env.sh installs it): no skip

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for batch in tokens:
            logits = model(batch[:, :-1]).logits
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            batch[:, 1:].reshape(-1)).item())
    return sum(losses) / len(losses)


@pytest.mark.multiproc
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_pretrain_checkpoint_exports_and_hf_matches_the_run(exported, recipe):
    out, results = exported
    result = results[recipe]
    assert result["exits"] == {"hf": 0, "megatron": 0, "het-from-hf": 0}, result["exits"]
    [(iteration, validation)] = result["validation"]
    assert iteration == ITERS
    export = out / recipe / "hf"
    assert (export / "tokenizer.json").is_file()  # the run's tokenizer, kept by the checkpoint
    hf = _hf_loss(export, result["tokens"])
    assert abs(hf - validation) <= ACCEPTANCE * validation, (hf, validation)
    assert abs(hf - validation) <= EXACT * validation, (hf, validation)
    assert abs(result["megatron_loss"] - validation) <= EXACT * validation, (result["megatron_loss"], validation)
    assert abs(result["het_from_hf_loss"] - validation) <= EXACT * validation, (result["het_from_hf_loss"], validation)
    assert validation < 6.0  # trained: below the uniform loss ln(512) = 6.24


# TP=2 over the two ranks of examples/clusters/cpu-2.yaml: each rank holds [gate_r; up_r] of the gated fc1.
TP2_PLAN = f"""{{"format": "megatron-het-plan", "version": 1, "micro_batch_size": 2, "global_batch_size": {GBS},
 "schedule": "1f1b", "replicas": [{{"num_micro_batches": {GBS // 2}, "stages": [
   {{"island": "cpu", "device_type": "CPU", "ranks": [0, 1], "layers": [0, 2]}}]}}]}}"""


def tp2_worker(rank: int, world_size: int, argv: list[str]):
    from megatron_het.cli.pretrain import run
    from megatron_het.platform import detect_accelerator
    from megatron_het.runtime.arguments import parse_args

    with contextlib.redirect_stdout(io.StringIO()):
        return run(parse_args(argv), detect_accelerator()).validation


@pytest.mark.multiproc
def test_tp2_swiglu_checkpoint_exports_to_the_runs_model(tmp_path, data):
    """The gated fc1 of a TP=2 stage is stored as the trainer's .gate/.up halves, so the export is
    [gate; up]. The tight bound is the check: TP shards' [gate_0; up_0; gate_1; up_1] read as [gate; up]
    would still pass the 2% acceptance here (it costs 1.2% of loss after these 10 iterations)."""
    from megatron_het.checkpoint.convert import ConvertRequest, convert
    from megatron_het.cli.pretrain import batch_fns
    from megatron_het.platform.local_launch import run_local
    from megatron_het.runtime.arguments import parse_args

    plan = tmp_path / "tp2.json"
    plan.write_text(TP2_PLAN)
    argv = [*data, *RECIPES["llama"], "--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-2.yaml"),
            "--hetero-plan", str(plan), "--save", str(tmp_path / "ckpt")]
    [(iteration, validation)] = run_local(2, tp2_worker, (argv,), timeout_s=600)[0]
    assert iteration == ITERS
    convert(ConvertRequest(input=str(tmp_path / "ckpt"), input_format="het", output=str(tmp_path / "hf"),
                           output_format="hf"))
    _, valid_fn = batch_fns(parse_args(argv))
    hf = _hf_loss(tmp_path / "hf", [valid_fn(0, range(GBS))])
    assert abs(hf - validation) <= ACCEPTANCE * validation, (hf, validation)
    assert abs(hf - validation) <= TP2_CLOSE * validation, (hf, validation)
