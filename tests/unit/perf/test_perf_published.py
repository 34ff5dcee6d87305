"""The published-runs data set, the compute-model fit and the iteration breakdown (#17 items 2-5)."""

import math

import pytest

from megatron_het.cluster import CATALOG, cluster_from_dict, load_model
from megatron_het.perf import calibrated
from megatron_het.perf import fit as fitting
from megatron_het.perf.breakdown import explain
from megatron_het.perf.compute import PRIORS, compute_params_for
from megatron_het.perf.profile import load_profile, save_profile
from megatron_het.perf.published import load_published, predict_row
from megatron_het.plan import homogeneous_plan

ROWS = load_published()


def test_data_set_size_sources_devices_and_citations():
    assert len(ROWS) >= 25
    assert len({r.source for r in ROWS}) >= 4
    assert len({r.device for r in ROWS}) >= 3
    assert len({r.key for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert r.where and r.url.startswith("https://"), r.key
        assert r.published > 0 and r.published_iteration_s > 0
        assert r.plan.global_batch_size % (r.plan.micro_batch_size * len(r.plan.replicas)) == 0
        assert r.gpus == r.plan.world_size
    sizes = [r.model.num_layers * 12 * r.model.hidden_size ** 2 for r in ROWS]
    assert min(sizes) < 0.5e9 and max(sizes) > 0.9e12  # 350M to 1T parameters


def test_narayanan_hardware_flops_convert_to_iteration_time():
    one_t = next(r for r in ROWS if r.key == "narayanan2021/gpt-1t")
    # 163 TFLOP/s per GPU on 3072 GPUs of Eq. 3's hardware FLOPs
    from megatron_het.perf.flops import model_flops_per_iteration

    flops = model_flops_per_iteration(one_t.model, global_batch_size=3072, recompute="full")
    assert one_t.published_iteration_s == pytest.approx(flops / (163e12 * 3072))


def test_step_time_rows_are_taken_as_published():
    rows = [r for r in ROWS if r.metric == "seconds_per_iteration"]
    assert rows  # dgxc_nemo publishes step times
    for r in rows:
        assert r.published_iteration_s == r.published
    row = next(r for r in ROWS if r.key == "dgxc_nemo/nemotron4-15b-bf16-16gpus")
    assert (row.published, row.plan.global_batch_size, row.model.seq_length, row.gpus) == (2.83, 64, 4096, 16)
    assert row.model.num_query_groups == 8 and row.attention_kernel == "hopper"


def test_fitted_device_types_exist_in_the_catalog():
    for names in fitting.FAMILIES.values():
        for name in names:
            assert name in CATALOG  # a renamed entry would silently lose its fit


def test_shipped_defaults_are_a_fit_and_override_priors():
    assert calibrated.FIT["rows"] == len(ROWS)
    assert set(calibrated.FIT["sources"]) == {r.source for r in ROWS}
    params = compute_params_for(CATALOG["A100-80GB"], "bf16")
    assert params.gemm_efficiency == pytest.approx(calibrated.FIT["theta"]["a100_16bit_gemm"], rel=1e-5)
    assert compute_params_for(CATALOG["MI250X"], "bf16") == PRIORS["amd"]["16bit"]  # no MI250X row: its prior


def test_fit_moves_towards_the_rows_and_profiles_round_trip(tmp_path):
    rows = [r for r in ROWS if r.source == "torchtitan"]
    result = fitting.fit(rows, rounds=1)
    before = [abs(e) for _, _, e in fitting.row_errors(rows, {k: v for k, (v, _) in fitting.PARAMETERS.items()})]
    after = [abs(e) for _, _, e in fitting.row_errors(rows, result.theta)]
    assert sum(after) < sum(before)
    # a parameter no row informs (no H100, no fp8 row here) stays at its prior
    assert result.theta["fp8_over_16bit"] == pytest.approx(fitting.PARAMETERS["fp8_over_16bit"][0], rel=0.02)
    for profile in fitting.profiles_for(result.theta):
        path = tmp_path / f"{profile.device}.json"
        save_profile(profile, path)
        back = load_profile(path)
        assert back.entries == () and back.compute_model == profile.compute_model
    row = rows[0]
    via_files = predict_row(row, profile=[load_profile(tmp_path / f"{d}.json") for d in ("A100-80GB",)])
    direct = predict_row(row, profile=fitting.profiles_for(result.theta))
    assert via_files.iteration_time_s == pytest.approx(direct.iteration_time_s, rel=1e-12)


def test_in_sample_errors_of_the_shipped_defaults():
    errors = [abs(p.iteration_time_s / r.published_iteration_s - 1) for r in ROWS for p in [predict_row(r)]]
    errors.sort()
    assert errors[len(errors) // 2] <= 0.10


def test_breakdown_adds_up_and_names_the_parts():
    model = load_model("examples/models/llama2-7b.yaml")
    cluster = cluster_from_dict({"islands": [{"name": "pod", "device": "H100-SXM", "nodes": 2, "gpus_per_node": 8}]})
    plan = homogeneous_plan(tp=2, pp=2, dp=4, num_layers=32, micro_batch_size=1, global_batch_size=128, island="pod",
                            device_type="H100-SXM")
    pred, parts = explain(plan, model, cluster)
    assert sum(parts.values()) == pytest.approx(pred.iteration_time_s, rel=1e-9)
    assert {"gemm:qkv", "gemm:fc1", "gemm:fc2", "gemm:projection", "gemm:logits", "attention", "kernel_overhead",
            "tp_communication", "bubble", "gradient_reduction", "optimizer"} <= set(parts)
    assert max(parts, key=parts.get) == "gemm:fc1"
    assert all(v >= 0 and math.isfinite(v) for v in parts.values())


def test_hopper_attention_kernel_is_faster_on_h100_only():
    theta = {k: v for k, (v, _) in fitting.PARAMETERS.items()}
    hopper = fitting.device_params(theta, attention_kernel="hopper")
    fa2 = fitting.device_params(theta, attention_kernel="fa2")
    for cls in ("16bit", "fp8"):
        assert hopper["H100-SXM"][cls].attention_efficiency == pytest.approx(
            fitting.HOPPER_ATTENTION_SPEEDUP * fa2["H100-SXM"][cls].attention_efficiency, rel=1e-12)
        assert hopper["H100-SXM"][cls].gemm_efficiency == fa2["H100-SXM"][cls].gemm_efficiency
    assert hopper["A100-80GB"] == fa2["A100-80GB"]  # the A100 has no Hopper kernel
    with pytest.raises(ValueError, match="Fix:"):
        fitting.device_params(theta, attention_kernel="fa3")


def test_rows_record_their_stack_and_are_priced_with_it():
    by_source = {}
    for r in ROWS:
        by_source.setdefault(r.source, set()).add((r.attention_kernel, r.fused_norm_casts))
    assert by_source["nemo2412"] == {("hopper", True)}  # Transformer Engine: cuDNN attention, LayerNormLinear
    assert by_source["llmfoundry"] == {("fa2", False)}  # 2023 FlashAttention-2, te.Linear per GEMM
    row = next(r for r in ROWS if r.key == "nemo2412/llama2-7b")
    theta = dict(calibrated.FIT["theta"])
    as_fa2 = predict_row(row, profile=fitting.profiles_for(theta, attention_kernel="fa2")).iteration_time_s
    (_, own, _), = fitting.row_errors([row], theta)
    assert own < as_fa2  # the faster Hopper kernel is what the row is priced with


def test_unknown_attention_kernel_is_a_config_error(tmp_path):
    import shutil

    from megatron_het.cluster import ConfigError

    shutil.copy("examples/published/torchtitan.yaml", tmp_path / "t.yaml")
    text = (tmp_path / "t.yaml").read_text().replace("  tp: 1\n", "  tp: 1\n  attention_kernel: fa3\n", 1)
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError, match="attention_kernel"):
        load_published(tmp_path)


def test_profile_round_trip_keeps_separate_fp8_casts(tmp_path):
    theta = dict(calibrated.FIT["theta"])
    profile = next(p for p in fitting.profiles_for(theta, fused_norm_casts=False) if p.device == "H100-SXM")
    save_profile(profile, tmp_path / "h.json")
    back = load_profile(tmp_path / "h.json")
    assert back.compute_model["fp8"].fused_norm_casts is False
    assert back.compute_model == profile.compute_model
