"""Why an idle island's alternative lost names the network its gradient reduction really crosses
(planner/idle.py): a link between islands only when the late stage's layers are held on both."""

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, load_model
from megatron_het.perf.predict import predict
from megatron_het.plan import Plan, ReplicaPlan, StagePlan, validate_plan
from megatron_het.planner.idle import crossed_link_gbps, reduction_reason

LLAMA7 = load_model("examples/models/llama2-7b.yaml")


def _cluster() -> ClusterSpec:
    islands = (IslandSpec(name="h100", device=CATALOG["H100-SXM"], nodes=1, gpus_per_node=8,
                          inter_node_bandwidth_gbps=400.0),
               IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=4, gpus_per_node=2,
                          inter_node_bandwidth_gbps=200.0),
               IslandSpec(name="mi250", device=CATALOG["MI250X"], nodes=1, gpus_per_node=8,
                          inter_node_bandwidth_gbps=200.0))
    # mi250's slowest link (to h100, 10) is not the one its layers' reduction crosses (to a100, 25)
    links = (LinkSpec(between=("h100", "a100"), bandwidth_gbps=100.0),
             LinkSpec(between=("h100", "mi250"), bandwidth_gbps=10.0),
             LinkSpec(between=("a100", "mi250"), bandwidth_gbps=25.0))
    return ClusterSpec(islands=islands, links=links)


def _stage(island: str, device: str, first_rank: int, tp: int, layers: tuple[int, int]) -> StagePlan:
    return StagePlan(island=island, device_type=device, ranks=tuple(range(first_rank, first_rank + tp)),
                     layers=layers)


def _plan(*replicas: tuple[StagePlan, ...]) -> Plan:
    m = 8
    return Plan(replicas=tuple(ReplicaPlan(stages=s, num_micro_batches=m) for s in replicas), micro_batch_size=1,
                global_batch_size=m * len(replicas), use_distributed_optimizer=True)


def _priced(plan: Plan, cluster: ClusterSpec):
    validate_plan(plan, LLAMA7, cluster)
    return plan, predict(plan, LLAMA7, cluster)


def test_cross_island_layers_name_the_link_between_their_holders_not_the_islands_slowest():
    cluster = _cluster()
    # replica 0 holds layers 0-3 on a100, replica 1 on mi250: that reduction crosses a100 <-> mi250
    plan = _plan((_stage("a100", "A100-80GB", 8, 2, (0, 4)), _stage("h100", "H100-SXM", 0, 4, (4, 32))),
                 (_stage("mi250", "MI250X", 10, 4, (0, 4)), _stage("h100", "H100-SXM", 4, 4, (4, 32))))
    assert crossed_link_gbps(cluster, plan, (0, 4)) == 25.0
    assert crossed_link_gbps(cluster, plan, (4, 32)) is None  # every holder on h100
    line = reduction_reason(cluster, _priced(plan, cluster), 0.5)
    assert line.startswith("links: ") and "25 Gbit/s" in line and "10 Gbit/s" not in line, line
    assert line.endswith("+0.5 s exposed")


def test_a_reduction_inside_one_island_names_that_island_and_its_network():
    cluster = _cluster()
    # two identical replicas: layers 0-3 reduced between a100 ranks on two nodes (200 Gbit/s), 4-31 on h100
    plan = _plan((_stage("a100", "A100-80GB", 8, 2, (0, 4)), _stage("h100", "H100-SXM", 0, 4, (4, 32))),
                 (_stage("a100", "A100-80GB", 10, 2, (0, 4)), _stage("h100", "H100-SXM", 4, 4, (4, 32))))
    priced = _priced(plan, cluster)
    late = max((s for r in priced[1].replicas for s in r.stages), key=lambda s: s.gradient_reduction_end_s)
    line = reduction_reason(cluster, priced, 0.25)
    assert line.startswith("gradient reduction: ") and "across islands" not in line, line
    names = {"a100": "within a100 (its 200 Gbit/s inter-node network)", "h100": "within h100 (one node)"}
    assert f"layers {late.layers[0]}-{late.layers[1] - 1} on {late.island}" in line and names[late.island] in line
