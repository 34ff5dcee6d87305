"""pretrain_gpt.py parses with Megatron-LM's own parser: every Megatron flag is known with Megatron's
default, and each one is honoured, announced as ignored, or refused by name (#35 item 1)."""

from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import sys

import pytest

from megatron_het.cluster import ConfigError
from megatron_het.runtime import flag_policy
from megatron_het.runtime.arguments import FLAGS, build_parser, parse_args
from megatron_het.runtime.megatron_parser import megatron_dests, megatron_parser, option_name

from support.paths import REPO

CLUSTER = os.path.join(REPO, "examples/clusters/cpu-demo.yaml")
MODEL = os.path.join(REPO, "examples/models/tiny-cpu.yaml")
PLAN = os.path.join(REPO, "examples/plans/cpu-demo-hetero.json")
BASE = ["--hetero-cluster", CLUSTER, "--hetero-plan", PLAN, "--hetero-model", MODEL, "--train-iters", "3",
        "--lr", "1e-3", "--mock-data"]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def megatron_only() -> argparse.ArgumentParser:
    """Megatron-LM's parser alone, as Megatron builds it (the reference for defaults)."""
    return megatron_parser(prog="megatron", description="")


def _non_default(action: argparse.Action):
    """A value other than the flag's default, as parsing would store it."""
    default = action.default
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if isinstance(action, argparse._StoreFalseAction):
        return False
    if isinstance(action, argparse._StoreConstAction):
        return action.const
    if action.choices:
        return next(c for c in action.choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 0.5
    value = "x" if default != "x" else "y"
    return [value] if action.nargs in ("+", "*") else value


def _review(parser, ns, given=()):
    honoured = {parser._option_string_actions[f.name].dest for f in FLAGS}
    defaults = {d: a.default for d, a in megatron_dests(parser).items()}
    return flag_policy.review_flags(ns, defaults=defaults, given=given, honoured=honoured, model=_model(),
                                    spell=lambda d: option_name(parser, d))


def _model(**kw):
    from megatron_het.cluster import ModelSpec

    return ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, **kw)


def test_the_parser_is_megatrons_with_megatrons_defaults(parser, megatron_only):
    ours, theirs = megatron_dests(parser), megatron_dests(megatron_only)
    assert len(theirs) > 700 and set(theirs) <= set(ours)
    different = {d: (ours[d].default, a.default) for d, a in theirs.items() if ours[d].default != a.default}
    assert different == {}


def test_every_megatron_flag_is_honoured_announced_or_refused(parser, megatron_only):
    """Set each flag, alone, to a value other than its default: the review either reads it (the
    honoured ones), returns one line naming it, or refuses it by name; none passes unremarked."""
    honoured = {parser._option_string_actions[f.name].dest for f in FLAGS}
    base = parser.parse_args(BASE)
    assert _review(parser, base) == [n for n in _review(parser, base)]  # defaults alone: no refusal
    quiet = set(_review(parser, base))
    counts = {"honoured": 0, "announced": 0, "refused": 0}
    for dest, action in megatron_dests(megatron_only).items():
        if dest in honoured:
            counts["honoured"] += 1
            continue
        ns = copy.copy(base)
        setattr(ns, dest, _non_default(action))
        flag = option_name(parser, dest)
        try:
            lines = set(_review(parser, ns, given={dest})) - quiet
        except ValueError as e:
            assert f"{flag} " in str(e) and "Fix:" in str(e)
            counts["refused"] += 1
            continue
        assert lines and all(flag in line for line in lines), f"{flag} set to {getattr(ns, dest)!r} passed silently"
        counts["announced"] += 1
    assert counts["honoured"] >= 50 and counts["announced"] >= len(flag_policy.IGNORED) - 2
    assert sum(counts.values()) == len(megatron_dests(megatron_only))


def test_policy_tables_name_real_megatron_flags(megatron_only):
    known = set(megatron_dests(megatron_only))
    for table in (flag_policy.IGNORED, flag_policy.BUILT, flag_policy.REFUSED_FIX):
        assert set(table) <= known, set(table) - known
    assert {f.name for f in FLAGS if not f.name.startswith("--hetero-") and f.name != "--no-emulation"} <= set(
        megatron_only._option_string_actions), "a Megatron spelling in FLAGS that Megatron does not have"


def test_the_runs_defaults_are_megatrons(megatron_only):
    """What a run does when a flag is not given is what Megatron-LM does (the typed configs, not only
    the namespace): linear decay, a log line every 100 iterations, 100 validation batches, 969,30,1."""
    args = parse_args(BASE)
    sections = {"train": args.train, "loop": args.loop, "data": args.data}
    checked = 0
    for flag in FLAGS:
        section, field = flag.to.split(".")
        action = megatron_only._option_string_actions.get(flag.name)
        if (action is None or section not in sections or action.default is None or field == "transformer_impl"
                or flag.name in BASE):
            continue
        default = tuple(action.default) if isinstance(action.default, list) else action.default  # configs hold tuples
        assert getattr(sections[section], field) == default, flag.name
        checked += 1
    assert checked >= 20
    assert (args.train.lr_decay_style, args.train.log_interval, args.loop.eval_iters) == ("linear", 100, 100)
    assert args.data.split == "969,30,1" and args.loop.eval_interval == 0  # Megatron: None, no periodic pass
    assert args.train.micro_batch_size == 2 and args.train.global_batch_size == 16  # from the plan, said so
    assert any("the plan's" in n for n in args.notes)


@pytest.mark.parametrize("extra,names", [
    (["--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "6"], ["moe_router_topk", "at most num_experts 4"]),
    (["--moe-router-topk", "1"], ["moe_router_topk", "the model has no experts"]),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01", "0.02"],
     ["--moe-aux-loss-coeff", "one value is supported"]),
    (["--context-parallel-size", "2"], ["--context-parallel-size 2", "#38"]),
    (["--openai-gelu"], ["--openai-gelu True", "exact GeLU"]),
    (["--swiglu", "--squared-relu"], ["squared_relu", "keep one of swiglu and squared_relu"]),
    (["--normalization", "L2Norm"], ["--normalization", "invalid choice"]),
    (["--apply-layernorm-1p"], ["--apply-layernorm-1p: megatron-core's local layers", "transformer-engine"]),
    (["--lr-decay-style", "WSD"], ["--lr-decay-style WSD needs", "--lr-wsd-decay-iters"]),
    (["--rampup-batch-size", "16", "16", "100"], ["--rampup-batch-size [16, 16, 100]"]),
    (["--decoupled-min-lr", "1e-5"], ["--decoupled-min-lr 1e-05 needs --decoupled-lr"]),
    (["--save-interval", "2", "--save-retain-interval", "3"],
     ["--save-retain-interval 3 must be a multiple of --save-interval 2"]),
    (["--profile", "--use-pytorch-profiler"], ["--use-pytorch-profiler writes its trace beside --tensorboard-dir"]),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
     ["--profile-step-start 5 must be >= 0 and below --profile-step-end 5"]),
    (["--yaml-cfg", "x.yaml"], ["--yaml-cfg x.yaml"]),
])
def test_refused_flags_exit_2_naming_each(extra, names, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err
    assert err.count("\n") < 12, "the usage line must stay short"


def test_several_refusals_are_listed_together(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--context-parallel-size", "2", "--fp8-format", "hybrid"])
    err = capsys.readouterr().err
    assert "--context-parallel-size 2" in err and "--fp8-format hybrid" in err


def test_announced_flags_and_defaults_are_said_once():
    notes = parse_args(BASE + ["--use-flash-attn", "--no-masked-softmax-fusion", "--swiglu"]).notes
    joined = "\n".join(notes)
    assert "--use-flash-attn True is ignored" in joined and "--no-masked-softmax-fusion False is ignored" in joined
    assert sum("--make-vocab-size-divisible-by" in n for n in notes) == 0  # Megatron's 128 is what is built
    nsys = parse_args(BASE + ["--profile"]).notes  # the host has no GPU: no nsys capture range
    assert any("--profile without --use-pytorch-profiler" in n and "nothing is captured" in n for n in nsys), nsys


def test_moe_flags_build_the_model():
    """Megatron-LM's MoE flags (Mixtral's example script's) land in the model description megatron-core builds
    from; the defaults are Megatron-LM's; --moe-grouped-gemm is a kernel choice, announced as such."""
    args = parse_args(BASE + ["--num-experts", "8", "--disable-bias-linear", "--moe-router-load-balancing-type",
                              "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
                              "--moe-grouped-gemm", "--moe-z-loss-coeff", "1e-3"])
    m = args.model
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (8, 2, 0.01, 0.001)
    assert m.moe_token_dispatcher_type == "alltoall" and m.moe_ffn_hidden_size == m.ffn_hidden_size
    assert any("--moe-grouped-gemm True is ignored" in n and "SequentialMLP" in n for n in args.notes)
    dense = parse_args(BASE).model
    assert not dense.is_moe and dense.moe_token_dispatcher_type == "allgather"  # Megatron-LM's default


def test_query_groups_count_only_with_group_query_attention():
    plain = parse_args(BASE + ["--num-query-groups", "2"])
    assert plain.model.num_query_groups == plain.model.num_attention_heads
    assert any("--num-query-groups 2 is ignored without --group-query-attention" in n for n in plain.notes)
    assert parse_args(BASE + ["--group-query-attention", "--num-query-groups", "2"]).model.num_query_groups == 2


def test_layout_flags_must_be_the_plans():
    from megatron_het.cli.pretrain import resolve_plan

    # the demo plan: one replica of two TP2 stages
    assert resolve_plan(parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                           "2"])) is not None
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size: .*\[2\].*got 1.*Fix"):
        resolve_plan(parse_args(BASE + ["--tensor-model-parallel-size", "1"]))
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        resolve_plan(parse_args(BASE + ["--pipeline-model-parallel-size", "4"]))


def test_missing_lr_is_megatrons_requirement(capsys):
    with pytest.raises(SystemExit):
        parse_args([a for a in BASE if a not in ("--lr", "1e-3")])
    assert "--lr: required" in capsys.readouterr().err


def test_refusal_comes_before_any_rendezvous():
    """Plain python, no torchrun variables: the refusal, not the how-to-launch line, and no traceback."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_scripts/pretrain_gpt.py"), *BASE,
                           "--context-parallel-size", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--context-parallel-size 4" in proc.stderr and "Traceback" not in proc.stderr
    assert "torchrun" not in proc.stderr


NO_PLAN = [a for a in BASE if a not in ("--hetero-plan", PLAN)]


def test_without_a_plan_file_megatrons_layout_flags_build_the_plan(capsys):
    from megatron_het.cli.pretrain import resolve_plan

    args = parse_args(NO_PLAN + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--decoder-first-pipeline-num-layers", "3", "--micro-batch-size", "2"])
    assert args.train.global_batch_size == 2  # Megatron: micro-batch x DP (1)
    plan = resolve_plan(args)
    assert [(s.island, s.ranks, s.layers) for s in plan.replicas[0].stages] == [
        ("fast", (0, 1), (0, 3)), ("slow", (2, 3), (3, 4))]
    assert plan.precision == "fp32"  # no --bf16: Megatron trains in fp32
    assert "Megatron-LM's layout from the flags (no --hetero-plan): TP 2 x PP 2 x DP 1" in capsys.readouterr().out


def test_expert_biases_are_refused_where_megatron_core_cannot_train_them(capsys):
    """megatron-core trains expert biases only with EP > 1 at expert-TP 1: without a plan file the flags
    decide (refused at parse, exit 2); with one, the plan does (refused when it is resolved)."""
    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.plan import PlanError

    sizes = ["--micro-batch-size", "2", "--global-batch-size", "8", "--num-experts", "4", "--sequence-parallel"]
    for extra, got in ((["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                        "--expert-model-parallel-size 2, expert-TP 2"), ([], "--expert-model-parallel-size 1")):
        with pytest.raises(SystemExit):
            parse_args(NO_PLAN + sizes + extra)
        err = capsys.readouterr().err
        assert "--num-experts with linear biases" in err and got in err, err
    with pytest.raises(PlanError, match="experts have linear biases"):
        resolve_plan(parse_args(BASE + ["--num-experts", "4", "--sequence-parallel"]))
    # TP 1, EP 2 (expert-TP = TP = 1): accepted
    assert parse_args(NO_PLAN + sizes + ["--expert-model-parallel-size", "2"]).model.add_bias_linear


def test_expert_parallel_flags_set_the_plans_expert_grid():
    """Megatron's --expert-model-parallel-size over its layout (TP 1 x PP 2 x DP 2 on the demo's 4 ranks):
    the plan's experts spread over the two replicas; too large an EP is refused naming the replicas."""
    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.plan import PlanError

    moe = ["--num-experts", "4", "--disable-bias-linear", "--pipeline-model-parallel-size", "2", "--micro-batch-size",
           "2", "--global-batch-size", "8"]
    plan = resolve_plan(parse_args(NO_PLAN + moe + ["--expert-model-parallel-size", "2"]))
    assert (plan.expert_parallel, plan.expert_tensor_parallel, len(plan.replicas)) == (2, None, 2)
    with pytest.raises(PlanError, match="spans 4 replicas, which do not divide the plan's 2"):
        resolve_plan(parse_args(NO_PLAN + moe + ["--expert-model-parallel-size", "4"]))


def test_without_a_plan_file_or_layout_flags_the_planner_chooses(capsys):
    from megatron_het.cli.pretrain import resolve_plan

    plan = resolve_plan(parse_args(NO_PLAN + ["--micro-batch-size", "2", "--global-batch-size", "16"]))
    assert plan.world_size == 4 and "the planner chooses" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--recompute-granularity", "full"], "--recompute-granularity full: --hetero-plan"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage 1: --hetero-plan"),
])
def test_layout_flags_beside_a_plan_file_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    assert message in capsys.readouterr().err


def test_selective_recompute_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(NO_PLAN + ["--micro-batch-size", "2", "--recompute-granularity", "selective"])
    assert "--recompute-granularity selective: not supported" in capsys.readouterr().err


def test_model_flags_reach_the_model():
    """#35 item 3 (first part): Megatron's flags for head width, init std, rotary base/share and norm
    epsilon are the model's (megatron-core's TransformerConfig and GPTModel take them)."""
    from megatron_het.model.gpt import StageModelSpec, transformer_config

    model = parse_args(BASE + ["--swiglu", "--kv-channels", "32", "--init-method-std", "0.006", "--rotary-base",
                               "500000", "--rotary-percent", "0.5", "--norm-epsilon", "1e-6"]).model
    assert (model.kv_channels, model.init_method_std, model.rotary_base, model.rotary_percent,
            model.layernorm_epsilon) == (32, 0.006, 500000, 0.5, 1e-6)
    config = transformer_config(StageModelSpec(model=model, num_layers=1, layer_offset=0, tp=1, pre_process=True,
                                               post_process=True, vocab_size=512))
    assert (config.kv_channels, config.init_method_std, config.layernorm_epsilon) == (32, 0.006, 1e-6)
    assert parse_args(BASE + ["--hidden-size", "128"]).model.kv_channels == 32  # the file's, re-derived: 128 / 4


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "512", "--micro-batch-size", "1"]
FLAGS_ONLY = [a for a in BASE if a not in ("--hetero-model", MODEL)] + SHAPE


def test_without_a_model_file_the_architecture_is_megatrons():
    """#35 item 3: --swiglu is the MLP alone; norm, positions, biases and dropout are Megatron's
    defaults unless their own flags say otherwise (Megatron-LM builds exactly this)."""
    m = parse_args(FLAGS_ONLY + ["--swiglu"]).model
    assert (m.swiglu, m.normalization, m.position_embedding_type, m.add_bias_linear, m.hidden_dropout,
            m.attention_dropout) == (True, "LayerNorm", "learned_absolute", True, 0.1, 0.1)
    m = parse_args(FLAGS_ONLY + ["--normalization", "RMSNorm", "--position-embedding-type", "rope",
                                 "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--squared-relu",
                                 "--hidden-dropout", "0.0", "--attention-dropout", "0.05"]).model
    assert (m.swiglu, m.squared_relu, m.normalization, m.position_embedding_type, m.add_bias_linear, m.add_qkv_bias,
            m.qk_layernorm, m.hidden_dropout, m.attention_dropout) == (
        False, True, "RMSNorm", "rope", False, True, True, 0.0, 0.05)


def test_a_model_file_keeps_its_recipe_and_flags_override_it(tmp_path):
    llama = tmp_path / "llama.yaml"
    llama.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nvocab_size: 512\n"
                     "swiglu: true\n")
    argv = [a if a != MODEL else str(llama) for a in BASE] + ["--micro-batch-size", "1"]
    m = parse_args(argv).model
    assert (m.normalization, m.position_embedding_type, m.add_bias_linear, m.hidden_dropout) == (
        "RMSNorm", "rope", False, 0.0)
    m = parse_args(argv + ["--normalization", "LayerNorm", "--hidden-dropout", "0.1"]).model
    assert (m.normalization, m.position_embedding_type, m.hidden_dropout) == ("LayerNorm", "rope", 0.1)


ARCHITECTURES = {
    "gpt2": {},
    "llama": {"swiglu": True},
    "swiglu-layernorm-bias": {"swiglu": True, "normalization": "LayerNorm", "add_bias_linear": True,
                              "position_embedding_type": "learned_absolute"},
    "rope-no-bias-qkv-bias-qk-norm": {"position_embedding_type": "rope", "add_bias_linear": False,
                                      "add_qkv_bias": True, "qk_layernorm": True},
    "rmsnorm-squared-relu-no-positions": {"normalization": "RMSNorm", "squared_relu": True,
                                          "position_embedding_type": "none", "untie_embeddings_and_output_weights": True},
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_megatron_core_builds_the_described_architecture(name):
    """The model megatron-core builds from a ModelSpec has exactly the tensors the converters
    (checkpoint/convert/state.expected_shapes) and the performance model (perf/flops) count."""
    from megatron_het.checkpoint.convert.state import expected_shapes
    from megatron_het.perf.flops import padded_vocab_size, total_parameters
    from megatron_het.plan.layout import homogeneous_plan
    from megatron_het.runtime.holdings import plan_holdings

    model = _model(**ARCHITECTURES[name])
    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=2, micro_batch_size=1, global_batch_size=1)
    built = {h.name: h.full_shape for h in plan_holdings(plan, model)}  # megatron-core's GPTModel, on meta
    want = expected_shapes(model)
    padded = padded_vocab_size(model.vocab_size, tp=1)
    want = {n: (padded, *s[1:]) if s[0] == model.vocab_size else s for n, s in want.items()}
    assert built == want
    vocab_pad = (padded - model.vocab_size) * model.hidden_size * (2 if model.untie_embeddings_and_output_weights else 1)
    assert sum(math.prod(s) for s in built.values()) - vocab_pad == total_parameters(model)


def test_each_architecture_flag_reaches_megatron_cores_config():
    from megatron_het.model.gpt import StageModelSpec, transformer_config

    model = _model(normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=True,
                   qk_layernorm=True, squared_relu=True, hidden_dropout=0.1, attention_dropout=0.2,
                   rotary_interleaved=True)
    c = transformer_config(StageModelSpec(model=model, num_layers=1, layer_offset=0, tp=1, pre_process=True,
                                          post_process=True, vocab_size=512))
    assert (c.normalization, c.add_bias_linear, c.add_qkv_bias, c.qk_layernorm, c.activation_func.__name__,
            c.gated_linear_unit, c.hidden_dropout, c.attention_dropout, c.rotary_interleaved) == (
        "RMSNorm", False, True, True, "squared_relu", False, 0.1, 0.2, True)
