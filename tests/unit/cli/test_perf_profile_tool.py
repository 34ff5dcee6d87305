"""tools/profile_host.py: the measured layers match the analytic shapes and the output loads."""

import subprocess
import sys

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.perf.flops import layer_parameters
from megatron_het.perf.profile import load_profile

from support.paths import REPO

TOOL = REPO / "tools" / "profile_host.py"


def _tool():
    from megatron_het.profiling import layers

    return layers


@pytest.mark.parametrize("model", [
    ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1),
    ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
              seq_length=16, vocab_size=1, swiglu=True),
], ids=["gpt", "llama-gqa"])
def test_reference_layer_has_the_analytic_parameter_count(model):
    layer = _tool().TorchReferenceLayer(model)
    assert sum(p.numel() for p in layer.parameters()) == layer_parameters(model)


def test_reference_profile_in_process():
    tool = _tool()
    import torch
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)
    profile = tool.profile_layers(model, num_layers=1, micro_batch_sizes=[1, 2], device="CPU", warmup=1, repeats=2,
                                  dtype=torch.float32, implementation="torch")
    assert [e.micro_batch_size for e in profile.entries] == [1, 2]
    assert profile.method.startswith("plain torch reference layer")
    params_bytes = 4 * layer_parameters(model)  # fp32
    small, large = profile.entries
    assert params_bytes < small.peak_memory_bytes < large.peak_memory_bytes
    assert all(e.forward_s > 0 and e.backward_s > 0 for e in profile.entries)


def test_cli_with_megatron_core(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(TOOL), "--num-layers", "1", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-sizes", "1,2",
                          "--warmup", "1", "--repeats", "2", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(out)
    assert profile.method.startswith("megatron-core TransformerLayer (local spec)"), profile.method
    assert [e.micro_batch_size for e in profile.entries] == [1, 2]
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)
    assert profile.entries[0].peak_memory_bytes > 4 * layer_parameters(model)


def _main_exit_code(argv) -> int:
    """tools/profile_host.py's ``main(argv)`` in this process: its exit code (argparse's errors exit 2).
    The argument checks run before anything is measured or megatron-core is imported, so the rejections
    below need no fresh Python + torch start-up each (the shim's own run is test_cli_with_megatron_core)."""
    from megatron_het.cli.profile_host import main

    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_cli_rejects_bad_sizes(tmp_path, capsys):
    code = _main_exit_code(["--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "16", "--micro-batch-sizes", "1,x", "--output", str(tmp_path / "p.json")])
    assert code == 2
    assert "--micro-batch-sizes: expected integers like 1,2,4 (got '1,x')" in capsys.readouterr().err


_COUNT_SCRIPT = """
import torch
from megatron_het.profiling import layers as tool
from megatron_het.cluster import ModelSpec
for swiglu in (False, True):
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2 if swiglu else None,
                      ffn_hidden_size=96 if swiglu else None, seq_length=16, vocab_size=1, swiglu=swiglu)
    layers, cleanup = tool._build_megatron(model, 1, torch.float32)
    print(sum(p.numel() for p in layers[0].parameters()))
    cleanup()
"""


def test_megatron_core_layer_has_the_analytic_parameter_count():
    # Separate process: megatron-core needs a process group and patches modules process-wide.
    run = subprocess.run([sys.executable, "-c", _COUNT_SCRIPT], capture_output=True, text=True,
                         timeout=300, cwd=TOOL.parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    gpt = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=16, vocab_size=1)
    llama = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=16, vocab_size=1, swiglu=True)
    # GPT: 12h^2 + 13h = 49152 + 832; Llama-style: h*(8+4)*8 + 64*64 + 64*192 + 96*64 + 2*64
    assert run.stdout.split() == [str(layer_parameters(gpt)), str(layer_parameters(llama))] == ["49984", "28800"]


def test_an_moe_profile_measures_the_moe_layer(tmp_path):
    """--num-experts: megatron-core's MoE layer (every expert's weights, the router) is what is timed, and
    the entries say so, so perf.compute prices MoE layers by them and dense layers never."""
    out = tmp_path / "moe.json"
    run = subprocess.run([sys.executable, str(TOOL), "--num-layers", "1", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-sizes", "2", "--swiglu",
                          "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                          "--ep-sizes", "2", "--warmup", "1", "--repeats", "2", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(out)
    entry, spread = profile.entries
    assert (entry.num_experts, entry.moe_router_topk, entry.moe_ffn_hidden_size, entry.ep) == (4, 2, 48, 1)
    # --ep-sizes 2: two experts on each of two processes, the all-to-all in the times
    assert (spread.num_experts, spread.ep, spread.tp) == (4, 2, 1) and spread.peak_memory_bytes < entry.peak_memory_bytes
    assert "MoE layer (4 experts" in profile.method
    moe = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1, swiglu=True,
                    add_bias_linear=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    # parameters (4 experts x 3 x 64 x 48, router 4 x 64, attention, norms) + what backward keeps
    assert entry.peak_memory_bytes > 4 * layer_parameters(moe) > 4 * 4 * 3 * 64 * 48


@pytest.mark.parametrize("args, message", [
    (["--num-experts", "4"], "Fix: pass --disable-bias-linear"),
    (["--moe-ffn-hidden-size", "48"], "--moe-ffn-hidden-size describes an MoE layer: pass --num-experts too"),
    (["--ep-sizes", "2"], "--ep-sizes"),
    (["--num-experts", "4", "--disable-bias-linear", "--ep-sizes", "3"], "must be >= 2 and divide --num-experts 4"),
    (["--num-experts", "6", "--disable-bias-linear", "--ep-sizes", "3", "--tp-sizes", "2"],
     "EP 3 beside TP 2: the layer runs on max(tp, ep) processes"),
    (["--moe-router-topk", "1"], "--moe-router-topk describes an MoE layer: pass --num-experts too"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "5"], "moe_router_topk"),
])
def test_cli_rejects_bad_moe_flags(tmp_path, capsys, args, message):
    code = _main_exit_code(["--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "16", "--output", str(tmp_path / "p.json"), *args])
    assert code == 2 and message in capsys.readouterr().err


def test_cli_measures_parts_optimizer_and_links(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(TOOL), "--num-layers", "1", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-sizes", "1,2",
                          "--warmup", "1", "--repeats", "2", "--vocab-size", "300", "--optimizer",
                          "--comm-ranks", "2", "--threads", "1", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(out)
    assert profile.machine["threads"] == 1
    # vocabulary padded like Megatron (multiple of 128); one embedding and one output entry per size
    assert sorted((p.part, p.micro_batch_size, p.vocab_size) for p in profile.parts) == [
        ("embedding", 1, 384), ("embedding", 2, 384), ("output", 1, 384), ("output", 2, 384)]
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in profile.parts)
    assert 0 < profile.optimizer_s_per_parameter < 1e-5
    link = profile.link
    assert link.ranks == 2 and link.bandwidth_gbps > 0 and link.latency_us >= 0
    assert {op for op, _, _ in link.samples} == {"all_reduce", "send_recv"} and len(link.samples) == 8
    assert "links of this host" in run.stdout


@pytest.mark.parametrize("args, message", [
    (["--comm-ranks", "1"], "--comm-ranks must be 0 (skip) or >= 2, got 1"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
])
def test_cli_rejects_bad_values(tmp_path, capsys, args, message):
    code = _main_exit_code(["--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "16", "--output", str(tmp_path / "p.json"), *args])
    assert code == 2 and message in capsys.readouterr().err


def test_tp2_layers_include_their_collectives(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(TOOL), "--num-layers", "1", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-sizes", "2",
                          "--tp-sizes", "1,2", "--warmup", "1", "--repeats", "2", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(out)
    by_tp = {e.tp: e for e in profile.entries}
    assert sorted(by_tp) == [1, 2]
    assert by_tp[2].includes_tp_comm and not by_tp[1].includes_tp_comm
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)
    # each TP rank holds half of the layer's weight matrices (norms and the row-parallel biases stay whole)
    assert by_tp[2].peak_memory_bytes < by_tp[1].peak_memory_bytes
    assert by_tp[2].forward_s > 0 and "tp=2 micro_batch_size=2" in run.stdout
    from megatron_het.cluster import CATALOG
    from megatron_het.perf.compute import layer_times
    lt = layer_times(model, CATALOG["CPU"], micro_batch_size=2, tp=2, profile=profile)
    assert lt.includes_tp_comm and lt.forward_s == by_tp[2].forward_s


def test_profile_clock_and_cache_sweep(monkeypatch):
    """``clock="thread"`` times with the emulation's clock (EmulationTimer clock=time.thread_time) and
    ``sweep_mib`` sweeps the caches before every timed repetition; both are undone afterwards."""
    tool = _tool()
    import torch
    ticks, swept = [0.0], []

    def fake_thread_clock():  # one "second" per reading, and whether a sweep buffer was live then
        ticks[0] += 1.0
        swept.append(tool._TIMING.sweep is not None)
        return ticks[0]

    monkeypatch.setitem(tool.CLOCKS, "thread", fake_thread_clock)
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1)
    profile = tool.profile_layers(model, num_layers=2, micro_batch_sizes=[1], device="CPU", warmup=1, repeats=2,
                                  dtype=torch.float32, implementation="torch", optimizer=True, clock="thread",
                                  sweep_mib=1)
    (entry,) = profile.entries
    assert entry.forward_s == entry.backward_s == 0.5  # one tick per stacked forward, 2 layers
    assert swept and all(swept)
    assert "clock thread" in profile.method and "1 MiB swept" in profile.method
    assert tool._TIMING.sweep is None and tool._TIMING.clock is __import__("time").perf_counter
    with pytest.raises(ValueError):
        tool.profile_layers(model, num_layers=1, micro_batch_sizes=[1], device="CPU", warmup=0, repeats=1,
                            dtype=torch.float32, implementation="torch", clock="cpu")


def test_cli_measures_the_split_backward(tmp_path):
    """--split-backward times the runtime's B (input gradients, linears' dW deferred) and W (the deferred dW)
    against the fused backward of the same layers: W does the weight GEMMs, so it is real work (a split that
    deferred nothing would give W ~ 0). On a layer this small B's bookkeeping can outweigh the GEMMs it
    skips (B share > 1 seen under load), so B is only bounded like the profile format bounds it."""
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(TOOL), "--num-layers", "2", "--hidden-size", "128",
                          "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-sizes", "2",
                          "--warmup", "2", "--repeats", "7", "--threads", "1", "--clock", "thread", "--split-backward",
                          "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(out)
    b, w = profile.backward_split
    assert 0.25 < w < 2.0 and 0.2 < b < 2.0, (b, w)
    assert "split backward (runtime/split_backward.py)" in profile.backward_split_method


def test_call_overhead_is_the_intercept_of_time_vs_layers(monkeypatch):
    """profiling.layers.measure_call_overhead: (n T(1) - T(n)) / (n - 1) of the stack's forward and backward;
    with times exactly a + b x layers it returns a (the timing itself is replaced: layers are counted by
    their parameters, one each)."""
    import torch

    import megatron_het.profiling.layers as layers_mod

    def fake_measure(run, params, **_):
        return 0.8e-3 + 4e-3 * len(params), 0.5e-3 + 7e-3 * len(params), 0

    monkeypatch.setattr(layers_mod, "measure", fake_measure)
    for n in (2, 4):
        layers = [torch.nn.Linear(1, 1, bias=False) for _ in range(n)]
        forward, backward, method = layers_mod.measure_call_overhead(layers, False, shape=(1, 1, 1),
                                                                     dtype=torch.float32, warmup=0, repeats=1)
        assert (forward, backward) == pytest.approx((0.8e-3, 0.5e-3), rel=1e-9)
        assert f"{n}-layer stack" in method


def test_call_overhead_needs_two_layers(tmp_path, capsys):
    from megatron_het.cli.profile_host import main

    with pytest.raises(SystemExit):
        main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
              "--call-overhead", "--output", str(tmp_path / "p.json")])
    assert "--call-overhead needs --num-layers >= 2" in capsys.readouterr().err
