"""pretrain_gpt.py's argument boundary: bad input fails with the flag and the fix, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_het.runtime.arguments import parse_args

from support.paths import REPO

ROOT = str(REPO)
CLUSTER = os.path.join(ROOT, "examples/clusters/cpu-demo.yaml")
MODEL = os.path.join(ROOT, "examples/models/tiny-cpu.yaml")
BASE = ["--hetero-cluster", CLUSTER, "--hetero-plan", "auto", "--hetero-model", MODEL,
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "3", "--lr", "1e-3"]


def test_model_file_and_flags_combine():
    args = parse_args(BASE + ["--mock-data", "--num-layers", "6", "--lr", "3e-4"])
    assert args.model.num_layers == 6 and args.model.hidden_size == 64
    assert args.train.lr == 3e-4 and args.train.global_batch_size == 16
    assert args.cluster.num_gpus == 4 and args.plan_source == "auto"


@pytest.mark.parametrize("extra,message", [
    ([], "give --data-path PREFIX"),
    (["--data-path", "x"], "--data-path needs --tokenizer-model"),
    (["--mock-data", "--global-batch-size", "15"], "global_batch_size 15 is not a multiple of micro_batch_size 2"),
    (["--mock-data", "--num-attention-heads", "5"], "num_attention_heads"),
])
def test_bad_arguments_name_the_problem(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cluster_typo_exits_cleanly(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("islands:\n  - name: a\n    device: A100-80G\n    nodes: 1\n    gpus_per_node: 2\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_scripts/pretrain_gpt.py"),
                           *BASE[:1], str(bad), *BASE[2:], "--mock-data"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "A100-80GB" in proc.stderr and "Traceback" not in proc.stderr


def test_overlap_flags_reach_the_plan_and_the_training_config(tmp_path):
    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.plan import Plan, ReplicaPlan, StagePlan, validate_plan
    from megatron_het.plan.serialize import save_plan

    stages = (StagePlan(island="fast", device_type="CPU", ranks=(0, 1), layers=(0, 2)),
              StagePlan(island="slow", device_type="CPU", ranks=(2,), layers=(2, 4)))
    plan = Plan(replicas=(ReplicaPlan(stages=stages, num_micro_batches=8),), micro_batch_size=2,
                global_batch_size=16)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    base = [a if a != "auto" else str(path) for a in BASE] + ["--mock-data", "--num-layers", "4"]
    args = parse_args(base + ["--sequence-parallel", "--tp-comm-overlap", "--overlap-grad-reduce",
                              "--ddp-bucket-size", "5000", "--hetero-tp-comm-overlap-chunks", "2"])
    assert (args.train.overlap_grad_reduce, args.train.ddp_bucket_size, args.train.tp_comm_overlap_chunks) == (
        True, 5000, 2)
    got = resolve_plan(args)
    assert got.sequence_parallel
    assert [s.tp_comm_overlap for s in got.replicas[0].stages] == [True, False]  # only the TP > 1 stage
    # without --sequence-parallel the overlap is refused, naming the stage and the fix
    with pytest.raises(Exception) as err:
        resolve_plan(parse_args(base + ["--tp-comm-overlap"]))
    assert "replicas[0].stages[0].tp_comm_overlap" in str(err.value) and "sequence_parallel" in str(err.value)
    plain = resolve_plan(parse_args(base))
    assert plain == plan and not plain.sequence_parallel
    validate_plan(plain, args.model, args.cluster)


@pytest.mark.parametrize("flag,precision", [([], "fp32"), (["--bf16"], "bf16")])
def test_auto_plans_at_the_precision_the_run_trains_in(flag, precision):
    """--hetero-plan auto prices the search at the flags' precision (no flag = fp32) and records it:
    the plan's attached prediction is what perf.predict says of the recorded plan."""
    import dataclasses

    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.perf import predict

    args = parse_args(BASE + ["--mock-data", *flag])
    plan = resolve_plan(args)
    assert plan.precision == precision
    assert predict(plan, args.model, args.cluster).iteration_time_s == pytest.approx(
        plan.predicted["iteration_time_s"], rel=1e-9)
    other = predict(dataclasses.replace(plan, precision="bf16" if precision == "fp32" else "fp32"), args.model,
                    args.cluster).iteration_time_s
    assert other != pytest.approx(plan.predicted["iteration_time_s"], rel=1e-6)  # the precision matters here


def test_auto_plan_takes_one_profile_per_island(tmp_path):
    """--hetero-profile takes several files (the demo's host profiles are one per emulated island), and
    the plan chosen is priced from each island's own."""
    import dataclasses

    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.perf import Profile, ProfileEntry, predict, save_profile

    args = parse_args(BASE + ["--mock-data"])
    m = args.model
    entry = ProfileEntry(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                         num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, swiglu=m.swiglu,
                         seq_length=m.seq_length, micro_batch_size=args.train.micro_batch_size, tp=1,
                         forward_s=0.01, backward_s=0.02, peak_memory_bytes=1000)
    paths, profiles = [], []
    for name, k in [(i.name, n + 1.0) for n, i in enumerate(args.cluster.islands)]:
        prof = Profile(device=args.cluster.island(name).device.name, island=name, method="test", entries=(
            dataclasses.replace(entry, forward_s=0.01 * k, backward_s=0.02 * k),))
        paths.append(str(tmp_path / f"{name}.json"))
        save_profile(prof, paths[-1])
        profiles.append(prof)
    args = parse_args(BASE + ["--mock-data", "--hetero-profile", *paths])
    assert args.profile == tuple(paths)
    plan = resolve_plan(args)
    assert predict(plan, args.model, args.cluster, profile=profiles).iteration_time_s == pytest.approx(
        plan.predicted["iteration_time_s"], rel=1e-9)


@pytest.fixture(scope="module")
def tokenizer_512(tmp_path_factory) -> str:
    """A real SentencePiece model of 512 pieces, trained on the first 60 documents of the shipped corpus."""
    import json

    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    work = tmp_path_factory.mktemp("tok")
    corpus = work / "small.jsonl"
    with open(os.path.join(ROOT, "examples/data/corpus.jsonl"), encoding="utf-8") as lines:
        corpus.write_text("".join(line for line, _ in zip(lines, range(60))), encoding="utf-8")
    assert json.loads(corpus.read_text(encoding="utf-8").splitlines()[0])["text"]
    return str(train_tokenizer(TokenizerTrainConfig(input=corpus, output_prefix=work / "sp512", vocab_size=512)).model_path)


# --tokenizer-model used to be found by scanning argv: the "=" form and the last position skipped the
# vocabulary check, and a too-small --vocab-size died mid-step with an IndexError in the embedding.
@pytest.mark.parametrize("form", ["equals", "last"])
def test_tokenizer_vocabulary_is_checked_in_every_flag_form(form, tokenizer_512, capsys):
    flag = [f"--tokenizer-model={tokenizer_512}"] if form == "equals" else ["--tokenizer-model", tokenizer_512]
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--data-path", "prefix", "--vocab-size", "100"] + flag)
    assert exc.value.code == 2
    assert "error: --vocab-size: the tokenizer has 512 pieces (got 100)" in capsys.readouterr().err
    args = parse_args(BASE + ["--data-path", "prefix"] + flag)  # no --vocab-size: the tokenizer's
    assert args.model.vocab_size == 512 and args.data.tokenizer_model == tokenizer_512


@pytest.mark.parametrize("form", ["equals", "last"])
@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_bad_tokenizer_file_is_one_line_naming_flag_and_file(form, bad, tmp_path):
    path = tmp_path / "tok.model"
    if bad == "empty":
        path.write_bytes(b"")
    flag = [f"--tokenizer-model={path}"] if form == "equals" else ["--tokenizer-model", str(path)]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_scripts/pretrain_gpt.py"),
                           *BASE, "--data-path", "prefix", *flag], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: --tokenizer-model: ") and f"'{path}'" in lines[0]
    assert ("file not found" if bad == "missing" else "is empty") in lines[0]


def test_every_flag_fills_its_config_field_with_the_field_default():
    import dataclasses

    from megatron_het.runtime.arguments import CONFIGS, FLAGS

    args = parse_args(BASE + ["--mock-data"])
    seen = set()
    for flag in FLAGS:
        section, field = flag.to.split(".")
        assert flag.name not in seen, f"{flag.name} declared twice"
        seen.add(flag.name)
        if section not in CONFIGS or section == "tensorboard" or flag.required or flag.name == "--mock-data":
            continue
        if not flag.name.startswith("--hetero-"):  # Megatron's flag: Megatron's default (test_megatron_flags.py)
            continue
        default = {f.name: f.default for f in dataclasses.fields(CONFIGS[section])}[field]
        assert getattr(getattr(args, section), field) == default, flag.name
    given = parse_args(BASE + ["--mock-data", "--distributed-timeout-minutes", "3", "--save-interval", "5",
                               "--split", "1,0,0", "--seed", "7", "--adam-eps", "1e-5", "--no-emulation"])
    assert (given.train.distributed_timeout_minutes, given.loop.save_interval, given.data.split) == (3, 5, "1,0,0")
    assert (given.train.seed, given.train.adam_eps, given.no_emulation) == (7, 1e-5, True)


MOE_FLAGS = ["--mock-data", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--swiglu"]


def test_the_auto_plan_of_an_moe_model_takes_its_expert_parallelism_from_the_planner_or_the_flag():
    """--hetero-plan auto: the planner searches EP for an MoE model; --expert-model-parallel-size fixes it;
    expert-TP is the planner's (the flag is refused with the fix); rank-failure recovery plans EP 1."""
    from megatron_het.cli.pretrain import auto_expert_parallel, resolve_plan
    from megatron_het.plan import validate_plan

    args = parse_args(BASE + MOE_FLAGS)
    assert auto_expert_parallel(args) == {}  # the planner searches EP 1, 2, 4
    fixed = parse_args(BASE + MOE_FLAGS + ["--expert-model-parallel-size", "2"])
    plan = resolve_plan(fixed)
    assert plan.expert_parallel == 2 and plan.sequence_parallel
    validate_plan(plan, fixed.model, fixed.cluster)
    resilient = parse_args(BASE + MOE_FLAGS + ["--hetero-resilience", "--hetero-resilience-store", "127.0.0.1:1"])
    assert auto_expert_parallel(resilient) == {"expert_parallel": 1}
    with pytest.raises(Exception, match="--expert-tensor-parallel-size: the planner plans expert-TP"):
        auto_expert_parallel(parse_args(BASE + MOE_FLAGS + ["--expert-tensor-parallel-size", "1"]))
    assert auto_expert_parallel(parse_args(BASE + ["--mock-data"])) == {}  # a dense model: nothing to choose
