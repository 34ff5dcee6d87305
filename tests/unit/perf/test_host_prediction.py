"""The demo's figure: a plan priced from a quick, cached profile of this host (#17 acceptance)."""

import dataclasses

from megatron_het.cluster import cluster_from_dict, load_model
from megatron_het.plan import homogeneous_plan
from megatron_het.profiling.host import host_key, predict_on_this_host

MODEL = load_model("examples/models/tiny-cpu.yaml")


def test_one_rank_plan_priced_from_a_cached_host_profile(tmp_path):
    cluster = cluster_from_dict({"islands": [{"name": "cpu", "device": "CPU", "nodes": 1, "gpus_per_node": 1}]})
    plan = dataclasses.replace(homogeneous_plan(tp=1, pp=1, dp=1, num_layers=MODEL.num_layers, micro_batch_size=2,
                                                global_batch_size=4), precision="fp32")
    first = predict_on_this_host(plan, MODEL, cluster, cache_dir=tmp_path)
    assert first.profile.precision == "fp32"  # timed in the dtype the plan trains in
    assert first.measured_now and first.profile_path.startswith(str(tmp_path))
    assert first.profile.entries and first.profile.parts and first.profile.optimizer_s_per_parameter
    # priced from the measurement, not the nominal 1 TFLOP/s CPU entry: milliseconds, not microseconds
    layer = first.profile.entries[0]
    assert first.iteration_time_s > 2 * MODEL.num_layers * (layer.forward_s + layer.backward_s)
    again = predict_on_this_host(plan, MODEL, cluster, cache_dir=tmp_path)
    assert not again.measured_now and again.profile_path == first.profile_path
    assert again.iteration_time_s == first.iteration_time_s
    # a pipeline plan's chunk calls: their fixed cost is measured too (and keys the cache)
    assert first.profile.call_overhead is not None and first.profile.backward_split is None  # 1F1B: fused backward
    assert host_key(MODEL, micro_batch_sizes=[2], ranks=1, threads=1, call_overhead=True) in first.profile_path
    assert host_key(MODEL, micro_batch_sizes=[2], ranks=1, threads=1) not in first.profile_path
    assert host_key(MODEL, micro_batch_sizes=[4], ranks=1, threads=1, call_overhead=True) not in first.profile_path
    # a bf16 plan is not priced from this fp32 profile: it gets its own, timed in bf16
    assert host_key(MODEL, micro_batch_sizes=[2], ranks=1, threads=1, precision="bf16",
                    call_overhead=True) not in first.profile_path


def test_a_cluster_on_the_thread_clock_is_profiled_in_thread_cpu_time_one_profile_per_island(tmp_path, monkeypatch):
    """Compute timed as the run times it: thread CPU time when the emulation paces devices in it, every
    rank of the run measured at once, each waiting as its island's emulated device does; one profile per
    island, and the plan's stages are priced from their own island's."""
    import megatron_het.profiling.layers as layers
    from megatron_het.cluster import load_cluster

    seen = []
    single = layers.profile_layers

    def spy_emulated(model, *, islands, slowdowns, **options):  # measured in this process: the routing is the point
        seen.append((options["clock"], list(islands), list(slowdowns), options["split_backward"],
                     options["call_overhead"]))
        base = single(model, **options)
        # the slow island's measurements made unlike the fast one's (layers, optimizer, B/W split, chunk
        # call), so its pricing shows which profile each figure came from
        return tuple(dataclasses.replace(
            base, island=name, optimizer_s_per_parameter=1e-8 * k, backward_split=(0.5 * k, 0.3),
            call_overhead=(1e-4 * k, 2e-4 * k), entries=tuple(
                dataclasses.replace(e, forward_s=e.forward_s * k, backward_s=e.backward_s * k) for e in base.entries))
            for name, k in (("fast", 1.0), ("slow", 2.0)))

    monkeypatch.setattr(layers, "profile_emulated", spy_emulated)
    import megatron_het.profiling.links as links

    monkeypatch.setattr(links, "measure_link", lambda ranks: None)  # links are not what this test is about
    from megatron_het.planner.modes import plan_best

    paced = load_cluster("examples/clusters/cpu-demo-paced.yaml")
    plan = dataclasses.replace(plan_best(MODEL, paced, global_batch_size=16, micro_batch_sizes=(2,)).plan,
                               precision="fp32")  # what the demo records (no precision flag)
    result = predict_on_this_host(plan, MODEL, paced, cache_dir=tmp_path)
    ranks = sorted((rank, st.island) for r in plan.replicas for st in r.stages for rank in st.ranks)
    islands = [name for _, name in ranks]
    slowdowns = [paced.slowdown(name) for name in islands]
    assert seen == [("thread", islands, slowdowns, plan.schedule == "zb-h1", True)]
    assert [p.island for p in result.profiles] == ["fast", "slow"] and len(result.profile_paths) == 2
    key = host_key(MODEL, micro_batch_sizes=[2], ranks=plan.world_size, threads=1, clock="thread",
                   emulated=list(zip(islands, slowdowns)), split_backward=plan.schedule == "zb-h1", call_overhead=True)
    assert all(key in path for path in result.profile_paths)
    assert "thread CPU time" in result.profile.method
    # each stage priced from its own island's profile: per layer, the slow island's entries are twice the
    # fast one's and its device 2x slower in the emulation
    per_layer = {}
    for rp, r in zip(result.prediction.replicas, plan.replicas):
        for sp, st in zip(rp.stages, r.stages):
            per_layer.setdefault(st.island, []).append(sp.forward_s / st.num_layers)
    assert min(per_layer["slow"]) > 3.0 * max(per_layer["fast"])  # 2 (profile) x 2 (slowdown), less the ends
    from megatron_het.perf.flops import stage_parameters

    k = {"fast": 1.0, "slow": 2.0}
    for rp, r in zip(result.prediction.replicas, plan.replicas):
        for j, (sp, st) in enumerate(zip(rp.stages, r.stages)):
            assert sp.backward_split == (0.5 * k[st.island], 0.3) and sp.call_overhead_s == (1e-4 * k[st.island],
                                                                                             2e-4 * k[st.island])
            params = stage_parameters(MODEL, num_layers=st.num_layers, is_first=j == 0, is_last=j == len(r.stages) - 1)
            shard = len(plan.replicas) if plan.use_distributed_optimizer else 1
            # the tied word embedding (both ends of every replica hold it) is sharded over its own group
            tied = MODEL.vocab_size * MODEL.hidden_size if j in (0, len(r.stages) - 1) else 0
            embedding_shard = 2 * len(plan.replicas) if plan.use_distributed_optimizer else 1
            expected = (params - tied) // shard + tied // embedding_shard
            assert abs(sp.optimizer_s - paced.slowdown(st.island) * 1e-8 * k[st.island] * expected) < 1e-12
    again = predict_on_this_host(plan, MODEL, paced, cache_dir=tmp_path)
    assert not again.measured_now and again.iteration_time_s == result.iteration_time_s and len(seen) == 1


def test_measured_times_price_only_the_precision_they_were_taken_in(tmp_path):
    """A profile timed in fp32 cannot price a bf16 plan (on CPU bf16 trains ~10x slower): a clear
    error naming both precisions and the fix; tf32 plans (fp32 storage) and unrecorded profiles pass."""
    import pytest

    from megatron_het.cluster import ConfigError
    from megatron_het.perf import Profile, ProfileEntry, predict
    from megatron_het.perf.profile import load_profile, save_profile

    entry = ProfileEntry(hidden_size=MODEL.hidden_size, num_attention_heads=MODEL.num_attention_heads,
                         num_query_groups=MODEL.num_query_groups, ffn_hidden_size=MODEL.ffn_hidden_size,
                         swiglu=MODEL.swiglu, seq_length=MODEL.seq_length, micro_batch_size=2, tp=1,
                         forward_s=0.01, backward_s=0.02, peak_memory_bytes=1000)
    fp32 = Profile(device="CPU", entries=(entry,), method="test", precision="fp32")
    path = tmp_path / "p.json"
    save_profile(fp32, path)
    assert load_profile(path).precision == "fp32"  # recorded in the file
    cluster = cluster_from_dict({"islands": [{"name": "cpu", "device": "CPU", "nodes": 1, "gpus_per_node": 1}]})
    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=MODEL.num_layers, micro_batch_size=2, global_batch_size=4)
    with pytest.raises(ConfigError) as err:
        predict(dataclasses.replace(plan, precision="bf16"), MODEL, cluster, profile=fp32)
    assert "timed in fp32, the plan trains in bf16" in str(err.value) and "--dtype bfloat16" in str(err.value) and "--precision fp32" in str(err.value)
    timed = predict(dataclasses.replace(plan, precision="fp32"), MODEL, cluster, profile=fp32).iteration_time_s
    assert predict(dataclasses.replace(plan, precision="tf32"), MODEL, cluster, profile=fp32).iteration_time_s == timed
    unrecorded = dataclasses.replace(fp32, precision=None)  # profiles written before the field: not checked
    assert predict(dataclasses.replace(plan, precision="bf16"), MODEL, cluster, profile=unrecorded).iteration_time_s > 0


def test_an_island_profiled_for_other_islands_only_is_refused_not_priced_nominally():
    """Per-island profiles (the demo's) given without one island's: a clear error, not the 1 TFLOP/s entry."""
    import pytest

    from megatron_het.cluster import ConfigError, load_cluster
    from megatron_het.perf import Profile, ProfileEntry, predict
    from megatron_het.planner.modes import plan_best

    entry = ProfileEntry(hidden_size=MODEL.hidden_size, num_attention_heads=MODEL.num_attention_heads,
                         num_query_groups=MODEL.num_query_groups, ffn_hidden_size=MODEL.ffn_hidden_size,
                         swiglu=MODEL.swiglu, seq_length=MODEL.seq_length, micro_batch_size=2, tp=1,
                         forward_s=0.01, backward_s=0.02, peak_memory_bytes=1000)
    fast = Profile(device="CPU", entries=(entry,), method="test", island="fast")
    paced = load_cluster("examples/clusters/cpu-demo-paced.yaml")
    plan = plan_best(MODEL, paced, global_batch_size=16, micro_batch_sizes=(2,)).plan
    with pytest.raises(ConfigError) as err:
        predict(plan, MODEL, paced, profile=[fast])
    assert "measured for island(s) fast, not for island 'slow'" in str(err.value) and "_slow.json" in str(err.value)
    with pytest.raises(ConfigError, match="not for island 'slow'"):
        plan_best(MODEL, paced, global_batch_size=16, micro_batch_sizes=(2,), profile=[fast])
    slow = dataclasses.replace(fast, island="slow")
    every = dataclasses.replace(fast, island=None)
    assert predict(plan, MODEL, paced, profile=[fast, slow]).iteration_time_s > 0
    assert predict(plan, MODEL, paced, profile=[fast, every]).iteration_time_s > 0  # the device-wide one stands in


def test_the_host_cache_key_holds_what_changes_an_moe_measurement():
    """Two MoE models that build different layers (dispatcher, aux loss, experts) or a model without
    biases never share a cached host profile; a dense model's key is as before (no MoE facts)."""
    import dataclasses

    moe = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2, add_bias_linear=False)
    key = dict(micro_batch_sizes=[2], ranks=1, threads=1)
    keys = {host_key(m, **key) for m in (
        MODEL, dataclasses.replace(MODEL, add_bias_linear=False), moe,
        dataclasses.replace(moe, moe_token_dispatcher_type="alltoall"), dataclasses.replace(moe, moe_aux_loss_coeff=0.01),
        dataclasses.replace(moe, num_experts=8))}
    assert len(keys) == 6


def test_a_host_profile_refuses_expert_biases_before_spawning(tmp_path):
    import dataclasses

    import pytest

    from megatron_het.cluster import ConfigError

    cluster = cluster_from_dict({"islands": [{"name": "cpu", "device": "CPU", "nodes": 1, "gpus_per_node": 1}]})
    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=MODEL.num_layers, micro_batch_size=2, global_batch_size=4)
    moe = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2)
    with pytest.raises(ConfigError, match="add_bias_linear.*Fix: price the model without linear biases"):
        predict_on_this_host(plan, moe, cluster, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing measured, nothing cached
