"""A fresh run (no --load, no supplied state) trains the single-process model of the same seed
(issue #34): pretrain_gpt.py's own ``run`` on plans of every kind, from nothing but the seed.

Before #34 every parity test started from a supplied full state, and a fresh TP=2 run trained a
corrupted model (TP rank 1's norms and position embeddings at zero). Here each plan is built from
the seed alone: its initial shards, gathered, must equal the seeded full model bit for bit
(``runtime/initial_values.py``; so every plan starts from the same model), and its 8 losses must
equal a single-process megatron-core run of the same seed within 1e-5 relative (fp32; bf16: 1e-3,
as tests/multiproc/test_mixed_precision.py). The holders' consistency check
(--check-weight-hash-across-dp-replicas-interval) runs in every run, before the first step and after
the last, and must report agreement.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.arguments import parse_args
from megatron_het.runtime.initial_values import SeededFullState
from megatron_het.sharding import RankShare, ShardedPlan

from support.paths import REPO
from support.real_data import make_real_data
from workers.fresh_workers import corrupted_holder_worker, fresh_start_worker, reference_worker

ITERS = 8
COMMON = ["--hetero-model", os.path.join(REPO, "examples/models/tiny-cpu.yaml"), "--num-layers", "6",
          "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", str(ITERS),
          "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--check-weight-hash-across-dp-replicas-interval", str(ITERS)]
CPU4 = os.path.join(REPO, "examples/clusters/cpu-4.yaml")
CPU2 = os.path.join(REPO, "examples/clusters/cpu-2.yaml")
PADDED_VOCAB = 512  # tiny-cpu's 512 is already a multiple of 128 x every TP size below
RTOL, BF16_RTOL = 1e-5, 1e-3


def _s(ranks, layers, *, island="cpu", device="CPU", grid=None, chunks=()):
    return StagePlan(island=island, device_type=device, ranks=tuple(ranks), layers=layers, tp_grid=grid,
                     chunk_layers=tuple(chunks))


def _plan(*replicas, precision="fp32", **kw) -> Plan:
    """A plan records its precision (a plan file's default is bf16): these train in fp32 unless told."""
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=2, global_batch_size=16, precision=precision, **kw)


TP2PP2 = _plan(([_s((0, 1), (0, 3)), _s((2, 3), (3, 6))], 8))
FOUR_RANKS = {  # name: (plan, extra flags)
    "tp4": (_plan(([_s(range(4), (0, 6))], 8)), ()),
    "pp4_uneven": (_plan(([_s((0,), (0, 1)), _s((1,), (1, 3)), _s((2,), (3, 4)), _s((3,), (4, 6))], 8)), ()),
    "tp2pp2": (TP2PP2, ()),
    "dp2_tp2": (_plan(([_s((0, 1), (0, 6))], 4), ([_s((2, 3), (0, 6))], 4)), ()),
    "dp2_tp2_distributed_optimizer": (_plan(([_s((0, 1), (0, 6))], 5), ([_s((2, 3), (0, 6))], 3)),
                                      ("--use-distributed-optimizer",)),
    # TP2 -> TP1 pipeline beside a TP1 replica of the whole model (mixed TP, two layouts, tied copies)
    "tp2_tp1_beside_tp1": (_plan(([_s((0, 1), (0, 4)), _s((2,), (4, 6))], 5), ([_s((3,), (0, 6))], 3)), ()),
    "pp2_beside_tp2": (_plan(([_s((0,), (0, 2)), _s((1,), (2, 6))], 3), ([_s((2, 3), (0, 6))], 5)), ()),
    "tp3d_122": (_plan(([_s(range(4), (0, 6), grid=(1, 2, 2))], 8)), ()),
    "interleaved_two_replicas": (_plan(([_s((0,), (0, 4), chunks=((0, 2), (3, 5))),
                                         _s((1,), (4, 6), chunks=((2, 3), (5, 6)))], 4),
                                       ([_s((2,), (0, 3), chunks=((0, 1), (3, 5))),
                                         _s((3,), (3, 6), chunks=((1, 3), (5, 6)))], 4),
                                       schedule="interleaved", virtual_pipeline_size=2), ()),
    "zb_h1_tp2_tp1": (_plan(([_s((0, 1), (0, 3)), _s((2,), (3, 6))], 6), ([_s((3,), (0, 6))], 2),
                            schedule="zb-h1"), ()),
    "sharded": (ShardedPlan(ranks=tuple(RankShare(rank=i, island="cpu", device_type="CPU", micro_batch_size=2,
                                                  num_micro_batches=(3, 2, 2, 1)[i], shard_fraction=(.4, .3, .2, .1)[i])
                                        for i in range(4)), global_batch_size=16), ()),
}
BF16 = {"tp2pp2_bf16": (dataclasses.replace(TP2PP2, precision="bf16"), ("--bf16",))}
TWO_RANKS = {"tp2": (_plan(([_s((0, 1), (0, 6))], 8)), ()),
             "pp2": (_plan(([_s((0,), (0, 2)), _s((1,), (2, 6))], 8)), ()),
             "dp2": (_plan(([_s((0,), (0, 6))], 6), ([_s((1,), (0, 6))], 2)), ()),
             # a tf32 plan: fp32 storage, TF32 matmuls asked of torch (the host has none: fp32 here)
             "tp2_tf32": (_plan(([_s((0, 1), (0, 6))], 8), precision="tf32"), ()),
             # a plan recording fused attention: torch SDPA in the local spec (its math kernel here)
             "tp2_sdpa": (dataclasses.replace(_plan(([_s((0, 1), (0, 6))], 8)), attention="fused"), ()),
             # --deterministic-mode (last: torch's deterministic switch is process-wide and stays on)
             "tp2_deterministic": (_plan(([_s((0, 1), (0, 6))], 8)), ("--deterministic-mode",))}
BRIDGED_CLUSTER = """islands:
  - {name: nv, device: A100-80GB, nodes: 1, gpus_per_node: 2}
  - {name: amd, device: MI250X, nodes: 1, gpus_per_node: 2}
links:
  - {between: [nv, amd], bandwidth_gbps: 100}
"""
# NVIDIA beside AMD: the cross-replica gradient groups and the pipeline boundary go through the het bridge
BRIDGED = {"bridged_nv_amd": (_plan(([_s((0, 1), (0, 3), island="nv", device="A100-80GB"),
                                      _s((2, 3), (3, 6), island="amd", device="MI250X")], 8)),
                                ("--hetero-device-stand-in",))}  # CPU processes stand in for both vendors


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    """pretrain_gpt.py's flags of every run: real tokenized data, as a user trains."""
    prefix, tokenizer = make_real_data(tmp_path_factory.mktemp("fresh_data"))
    return [*COMMON, "--data-path", prefix, "--tokenizer-model", tokenizer, "--split", "98,2,0",
            "--data-cache-path", str(tmp_path_factory.mktemp("fresh_cache"))]


def _argv(common, *extra):
    return [*common, "--hetero-cluster", CPU4, "--hetero-plan", "unused", *extra]


def _cases(table, cluster):
    return [(name, plan, cluster, list(extra)) for name, (plan, extra) in table.items()]


@pytest.fixture(scope="module")
def seeded(common):
    args = parse_args(_argv(common))
    return {n: t.clone() for n, t in SeededFullState(args.model, seed=args.train.seed, padded_vocab=PADDED_VOCAB).items()}


def _reference(common, *extra):
    return [log.lm_loss for log in run_local(1, reference_worker, (_argv(common, *extra), PADDED_VOCAB))[0].iterations]


def _check_run(per_rank, name, ref_losses, seeded, rtol):
    initial = assemble_full_state([r[name]["initial"] for r in per_rank if r[name]["initial"]])
    assert set(initial) == set(seeded), name
    for tensor_name, value in initial.items():
        assert torch.equal(value.float(), seeded[tensor_name].to(value.dtype).float()), \
            f"{name}: initial {tensor_name} differs from the seeded full model"
    losses = per_rank[0][name]["losses"]
    assert len(losses) == ITERS
    assert losses == pytest.approx(ref_losses, rel=rtol), f"{name}: {losses} vs {ref_losses}"
    assert losses[-1] < losses[0]
    log = per_rank[0][name]["log"]
    assert "weight check at start: every holder agrees" in log, log[-2000:]
    assert f"weight check after iteration {ITERS}: every holder agrees" in log


@pytest.mark.multiproc
def test_fresh_tp2_pp2_trains_the_single_process_model(common, seeded):
    """The make-test tier's fresh run: TP2 x PP2 from the seed, checked as in the slow suite."""
    ref = _reference(common)
    per_rank = run_local(4, fresh_start_worker, (_cases({"tp2pp2": (TP2PP2, ())}, CPU4), common), timeout_s=900)
    _check_run(per_rank, "tp2pp2", ref, seeded, RTOL)


@pytest.mark.multiproc
def test_the_check_names_a_holder_that_differs(common):
    """TP rank 1's replicated parameters zeroed (the state a fresh TP run had before #34): every rank
    raises, naming a norm weight and the ranks on each side."""
    per_rank = run_local(4, corrupted_holder_worker, (TP2PP2, common, CPU4), timeout_s=900)
    assert all(e is not None for e in per_rank), per_rank
    assert len(set(per_rank)) == 1  # the same verdict on every rank
    message = per_rank[0]
    assert "weight check after zeroing: holders of" in message
    assert "decoder.layers.0.input_layernorm.weight[0:64]: ranks [0] sum 64; ranks [1] sum 0" in message, message
    assert "decoder.layers.3.input_layernorm.weight[0:64]: ranks [2] sum 64; ranks [3] sum 0" in message


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_plan_kind_trains_the_single_process_model_from_the_seed(common, seeded, tmp_path):
    ref = _reference(common)
    ref_bf16 = _reference(common, "--bf16")
    bridged = tmp_path / "nv-amd.yaml"
    bridged.write_text(BRIDGED_CLUSTER)
    four = run_local(4, fresh_start_worker, (_cases(FOUR_RANKS, CPU4) + _cases(BF16, CPU4)
                                             + _cases(BRIDGED, str(bridged)), common), timeout_s=1800)
    two = run_local(2, fresh_start_worker, (_cases(TWO_RANKS, CPU2), common), timeout_s=900)
    for name in FOUR_RANKS:
        _check_run(four, name, ref, seeded, RTOL)
    for name in BRIDGED:
        _check_run(four, name, ref, seeded, RTOL)
        assert "het bridge" in four[0][name]["log"]
    for name in TWO_RANKS:
        _check_run(two, name, ref, seeded, RTOL)
    assert "fp32 matmuls: TF32 (plan precision tf32" in two[0]["tp2_tf32"]["log"]
    assert two[0]["tp2_sdpa"]["attention"] == ["SdpaAttention"] and two[0]["tp2"]["attention"] == ["DotProductAttention"]
    assert "fp32 matmuls: torch's default" in two[0]["tp2"]["log"]
    assert ("deterministic mode: torch deterministic algorithms on; NCCL_ALGO=Ring"
            in two[0]["tp2_deterministic"]["log"]) and "deterministic mode" not in two[0]["tp2"]["log"]
    _check_run(four, "tp2pp2_bf16", ref_bf16, seeded, BF16_RTOL)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_fresh_run_and_its_resumed_half_train_the_same_model(common, tmp_path):
    """#34: a fresh TP2 run saved at iteration 4 and resumed jumped (6.156 -> 6.027 at iteration 5)
    because the checkpoint held one copy of TP rank 1's zeroed norms. Now the 4 + 4 iterations of a
    save and a resume equal the 8 of an uninterrupted run (the check runs after the load too)."""
    ckpt = str(tmp_path / "ckpt")
    tp2 = TWO_RANKS["tp2"][0]
    cases = [("whole", tp2, CPU2, []), ("first", tp2, CPU2, ["--train-iters", "4", "--lr-decay-iters", str(ITERS),
                                                                "--save", ckpt]),  # the whole run's schedule
             ("resumed", tp2, CPU2, ["--load", ckpt])]
    out = run_local(2, fresh_start_worker, (cases, common), timeout_s=900)[0]
    assert out["first"]["losses"] + out["resumed"]["losses"] == pytest.approx(out["whole"]["losses"], rel=1e-7, abs=0)
    assert "weight check after loading iteration 4: every holder agrees" in out["resumed"]["log"]


# Megatron's architecture flags on the tiny model (#35 item 3): RMSNorm, rotary, no linear biases but a
# QKV bias, q/k norms (shared by the heads each TP rank holds: their gradients are summed over TP),
# squared ReLU and interleaved rotary pairs
ARCHITECTURE = ("--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                "--add-qkv-bias", "--qk-layernorm", "--squared-relu", "--rotary-interleaved")


@pytest.mark.multiproc
def test_architecture_flags_train_the_single_process_model_under_tp2(common):
    ref = _reference(common, *ARCHITECTURE)
    plan = TWO_RANKS["tp2"][0]
    out = run_local(2, fresh_start_worker, ([("tp2", plan, CPU2, list(ARCHITECTURE))], common), timeout_s=900)[0]
    losses = out["tp2"]["losses"]
    assert losses == pytest.approx(ref, rel=RTOL), (losses, ref)
    assert losses[-1] < losses[0]
    assert f"weight check after iteration {ITERS}: every holder agrees" in out["tp2"]["log"]


@pytest.mark.multiproc
def test_logged_params_norm_and_zero_gradients_are_the_whole_models(common):
    """--log-params-norm / --log-num-zeros-in-grad (Megatron's log-line fields): under TP2 x PP2 the
    norm after the last step is the norm of the single-process run's final model (float64 over its
    assembled tensors, each counted once); TP2 x PP2 and TP4 count the same zero gradients every
    iteration: the untied word-embedding rows of tokens a batch lacks (h = 64 zeros per row), each
    element once, give or take an element whose gradient rounds to zero in one layout only."""
    import re

    flags = ("--log-params-norm", "--log-num-zeros-in-grad", "--untie-embeddings-and-output-weights")
    cases = {"tp2pp2": (TP2PP2, flags), "tp4": (FOUR_RANKS["tp4"][0], flags)}
    out = run_local(4, fresh_start_worker, (_cases(cases, CPU4), common), timeout_s=900)[0]
    norms, zeros = {}, {}
    for name in cases:
        log = out[name]["log"]
        norms[name] = [float(m) for m in re.findall(r"\| params norm: ([0-9.]+) ", log)]
        zeros[name] = [int(m) for m in re.findall(r"\| num zeros: ([0-9]+) ", log)]
        assert len(norms[name]) == len(zeros[name]) == ITERS, log[-3000:]
    reference = run_local(1, reference_worker, (_argv(common, flags[-1]), PADDED_VOCAB))[0]
    final = assemble_full_state([reference.shards])
    want = torch.sqrt(sum(t.double().pow(2).sum() for t in final.values())).item()
    assert norms["tp2pp2"][-1] == pytest.approx(want, rel=1e-5, abs=5e-4), (norms["tp2pp2"][-1], want)  # .3f
    assert norms["tp4"] == pytest.approx(norms["tp2pp2"], abs=1e-3) and norms["tp2pp2"][0] != norms["tp2pp2"][-1]
    assert all(abs(a - b) <= 2 for a, b in zip(zeros["tp2pp2"], zeros["tp4"])), zeros
    assert min(zeros["tp4"]) >= 64 * 10, zeros  # rows of unseen tokens: whole rows of zeros


@pytest.mark.multiproc
def test_exit_interval_and_duration_end_the_run_with_a_checkpoint(common, tmp_path):
    """Megatron's --exit-interval (a Slurm job split into pieces) and --exit-duration-in-mins (a time
    limit): the run stops after that iteration, saves it when --save is given, and skips the final
    validation, as Megatron-LM's exit does."""
    from megatron_het.checkpoint.dist_ckpt import latest_iteration

    tp2 = TWO_RANKS["tp2"][0]
    cases = [("interval", tp2, CPU2, ["--exit-interval", "3", "--save", str(tmp_path / "a"), "--eval-iters", "1"]),
             ("duration", tp2, CPU2, ["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path / "b")])]
    out = run_local(2, fresh_start_worker, (cases, common), timeout_s=900)[0]
    assert len(out["interval"]["losses"]) == 3 and latest_iteration(str(tmp_path / "a")) == 3
    assert "exiting program at iteration 3 (--exit-interval 3)" in out["interval"]["log"]
    assert "validation loss" not in out["interval"]["log"]
    assert len(out["duration"]["losses"]) == 1 and latest_iteration(str(tmp_path / "b")) == 1
    assert "(--exit-duration-in-mins 1e-09)" in out["duration"]["log"]


DECOUPLED = ("--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-4", "--lr-decay-style", "cosine",
             "--min-lr", "1e-5", "--lr-warmup-iters", "2")


@pytest.mark.multiproc
def test_decoupled_lr_trains_what_megatron_cores_optimizer_groups_train(common):
    """--decoupled-lr/--decoupled-min-lr: the reference is megatron-core's own optimizer, whose param
    groups put the word embedding and output layer on that rate (is_embedding_or_output_parameter);
    TP2 x PP2 (plain AdamW groups) and DP2 x TP2 with the distributed optimizer (a rate per element
    of each shard) train the same losses, and a run without the flags trains other ones."""
    ref = _reference(common, *DECOUPLED)
    plain = _reference(common, *DECOUPLED[4:])
    dist_opt = FOUR_RANKS["dp2_tp2_distributed_optimizer"]
    cases = {"tp2pp2": (TP2PP2, DECOUPLED), "dp2_tp2_dist_opt": (dist_opt[0], DECOUPLED + dist_opt[1])}
    out = run_local(4, fresh_start_worker, (_cases(cases, CPU4), common), timeout_s=900)[0]
    for name in cases:
        assert out[name]["losses"] == pytest.approx(ref, rel=RTOL), (name, out[name]["losses"], ref)
    assert ref[-1] != pytest.approx(plain[-1], rel=1e-4), (ref, plain)


@pytest.mark.multiproc
def test_profile_writes_a_torch_trace_of_the_window_on_the_profiled_rank(common, tmp_path):
    """Megatron's --profile --use-pytorch-profiler: iterations [start, end) traced on --profile-ranks,
    written where Megatron writes it (beside --tensorboard-dir, torch_profile/rank-R.json.gz)."""
    import gzip
    import json

    flags = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
             "--profile-ranks", "1", "--tensorboard-dir", str(tmp_path / "tb")]
    run_local(2, fresh_start_worker, ([("profiled", TWO_RANKS["tp2"][0], CPU2, flags)], common), timeout_s=900)
    traces = sorted(p.name for p in (tmp_path / "torch_profile").iterdir())
    assert traces == ["rank-1.json.gz"], traces
    events = json.loads(gzip.decompress((tmp_path / "torch_profile" / "rank-1.json.gz").read_bytes()))["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps


@pytest.mark.multiproc
def test_no_load_optim_and_finetune_load_what_megatron_loads(common, tmp_path):
    """--no-load-optim resumes the weights, iteration and data but not Adam's moments: its first loss
    (a forward of the loaded weights on the next batch) is the resumed run's, the next one is not.
    --finetune takes the weights only: iteration 1 again, the data from its first sample."""
    import re

    ckpt = str(tmp_path / "ckpt")
    tp2 = TWO_RANKS["tp2"][0]
    cases = [("first", tp2, CPU2, ["--train-iters", "4", "--lr-decay-iters", str(ITERS), "--save", ckpt]),
             ("resumed", tp2, CPU2, ["--load", ckpt]),
             ("no_optim", tp2, CPU2, ["--load", ckpt, "--no-load-optim"]),
             ("finetune", tp2, CPU2, ["--load", ckpt, "--finetune", "--train-iters", "3"])]
    out = run_local(2, fresh_start_worker, (cases, common), timeout_s=900)[0]
    resumed, no_optim = out["resumed"]["losses"], out["no_optim"]["losses"]
    assert len(resumed) == len(no_optim) == ITERS - 4
    assert no_optim[0] == resumed[0] and no_optim[1] != resumed[1], (no_optim, resumed)
    assert "optimizer state not loaded (--no-load-optim)" in out["no_optim"]["log"]
    finetune = out["finetune"]
    assert len(finetune["losses"]) == 3 and finetune["losses"][0] < out["first"]["losses"][0]
    assert re.search(r"iteration +1/ +3 \| consumed samples: +16 ", finetune["log"]), finetune["log"][-2000:]
    assert "to fine-tune from iteration 0" in finetune["log"]


@pytest.mark.multiproc
def test_save_retain_interval_keeps_the_multiples_and_the_latest(common, tmp_path):
    """Megatron's --save-retain-interval: saves at 2, 4, 6 and 8; each new save deletes the one it
    replaces unless that one's iteration is a multiple of 4: 4 and 8 remain, 8 as the latest."""
    from megatron_het.checkpoint.dist_ckpt import latest_iteration

    ckpt = tmp_path / "ckpt"
    flags = ["--save", str(ckpt), "--save-interval", "2", "--save-retain-interval", "4"]
    out = run_local(2, fresh_start_worker, ([("retain", TWO_RANKS["tp2"][0], CPU2, flags)], common), timeout_s=900)[0]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000008"]
    assert latest_iteration(str(ckpt)) == 8
    assert out["retain"]["log"].count("deleted checkpoint") == 2


@pytest.mark.multiproc
def test_validation_runs_without_dropout(common):
    """Megatron-LM evaluates in eval mode: with dropout 0.5 two validation passes over one batch give one
    loss, and training afterwards runs with dropout again (the modules are back in training mode)."""
    from workers.fresh_workers import evaluate_twice_worker

    first, second, training, step = run_local(2, evaluate_twice_worker, (TWO_RANKS["tp2"][0], common, CPU2),
                                              timeout_s=600)[0]
    assert first == second and training, (first, second, training)
    assert step != pytest.approx(first, rel=1e-3)  # a training batch under dropout: another loss
