"""sbatch generation for Slurm heterogeneous jobs: job shape, errors, golden scripts (CLI: tests/unit/cli/test_slurm_cli.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from megatron_het.cluster import cluster_from_dict, load_cluster
from megatron_het.launch import (
    IslandPlacement,
    JobOptions,
    LaunchError,
    het_components,
    island_environment,
    nodelist_size_hint,
    parse_assignments,
    placements_from_options,
    render_sbatch,
)
from megatron_het.plan import Plan, RankShare, ReplicaPlan, ShardedPlan, StagePlan

from support.paths import GOLDEN, REPO

ROOT = REPO
CPU_DEMO = "examples/clusters/cpu-demo.yaml"
CPU_PLAN = "examples/plans/cpu-demo-hetero.json"
GPU_CLUSTER = "examples/clusters/a100-mi250x.yaml"
GPU_PLAN = "tests/golden/a100-mi250x-plan.json"
DEMO_ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
             "--micro-batch-size 2 --global-batch-size 16 --train-iters 3 --lr 1e-3 --mock-data --vocab-size 512").split()


def _cpu():
    return load_cluster(ROOT / CPU_DEMO), Plan.load(ROOT / CPU_PLAN)


def _plan(*stages: tuple[str, str, tuple[int, ...]]) -> Plan:
    """One replica, one stage per (island, device, ranks), one layer each."""
    return Plan(replicas=(ReplicaPlan(stages=tuple(
        StagePlan(island=i, device_type=d, ranks=r, layers=(k, k + 1)) for k, (i, d, r) in enumerate(stages)),
        num_micro_batches=1),), micro_batch_size=1, global_batch_size=1)


def test_cpu_demo_components():
    cluster, plan = _cpu()
    comps = het_components(cluster, plan, {"fast": IslandPlacement(island="fast", partition="p0")})
    assert [(c.index, c.island, c.nodes, c.procs_per_node, c.first_node_rank, c.first_rank) for c in comps] == [
        (0, "fast", 1, 2, 0, 0), (1, "slow", 1, 2, 1, 2)]
    assert comps[0].partition == "p0" and comps[1].partition is None
    assert comps[0].gpus_per_node == 0 and comps[0].environment == ()


def test_gpu_components_use_only_the_nodes_the_plan_needs():
    cluster, plan = load_cluster(ROOT / GPU_CLUSTER), Plan.load(ROOT / GPU_PLAN)
    comps = het_components(cluster, plan, {})
    # 24 of the 32 A100s (3 of 4 nodes), 8 of the 16 MI250X GCDs (1 of 2 nodes).
    assert [(c.island, c.vendor, c.nodes, c.procs_per_node, c.first_node_rank, c.first_rank, c.gpus_per_node)
            for c in comps] == [("a100-pod", "nvidia", 3, 8, 0, 0, 8), ("mi250-pod", "amd", 1, 8, 3, 24, 8)]
    assert dict(comps[1].environment)["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
    assert "HSA_FORCE_FINE_GRAIN_PCIE" not in dict(comps[0].environment)


def test_unused_island_gets_no_component():
    cluster, _ = _cpu()
    comps = het_components(cluster, _plan(("slow", "CPU", (0, 1))), {})
    assert [(c.index, c.island, c.first_rank) for c in comps] == [(0, "slow", 0)]


def test_ranks_out_of_island_order_are_refused():
    cluster, _ = _cpu()
    plan = _plan(("fast", "CPU", (2, 3)), ("slow", "CPU", (0, 1)))
    with pytest.raises(LaunchError, match=r"island fast.*must hold ranks 0\.\.1.*Fix: renumber"):
        het_components(cluster, plan, {})


def test_too_many_ranks_for_island():
    cluster, _ = _cpu()
    with pytest.raises(LaunchError, match=r"3 ranks exceed the island's 2 GPUs \(1 nodes x 2\)"):
        het_components(cluster, _plan(("fast", "CPU", (0, 1, 2))), {})


def test_ranks_must_fill_whole_nodes():
    cluster = load_cluster(ROOT / GPU_CLUSTER)
    plan = _plan(("a100-pod", "A100-80GB", tuple(range(12))))
    with pytest.raises(LaunchError, match=r"12 ranks do not fill whole nodes of 8 GPUs.*multiple of 8"):
        het_components(cluster, plan, {})


def test_unknown_island_in_plan():
    cluster, _ = _cpu()
    with pytest.raises(LaunchError, match=r"plan: places ranks on an island the cluster does not have \(got 'medium'\)"
                                          r".*islands: fast, slow"):
        het_components(cluster, _plan(("medium", "CPU", (0,))), {})


def test_nodelist_must_match_node_count():
    cluster = load_cluster(ROOT / GPU_CLUSTER)
    plan = Plan.load(ROOT / GPU_PLAN)
    placements = {"a100-pod": IslandPlacement(island="a100-pod", nodelist="gpu[0-3]")}
    with pytest.raises(LaunchError, match=r"lists 4 nodes but .* need 3 .*list exactly 3"):
        het_components(cluster, plan, placements)


def test_nodelist_size_hint():
    assert nodelist_size_hint("n[0-3],m5") == 5
    assert nodelist_size_hint("gpu[01-02,07]") == 3
    assert nodelist_size_hint("n0") == 1
    assert nodelist_size_hint("n[a-b]") is None


def test_assignments_and_placements():
    cluster, _ = _cpu()
    assert parse_assignments(["fast=p0", "slow=p1"], option="--partition") == {"fast": "p0", "slow": "p1"}
    with pytest.raises(LaunchError, match=r"--partition: expected ISLAND=VALUE \(got 'fast'\)"):
        parse_assignments(["fast"], option="--partition")
    with pytest.raises(LaunchError, match="given twice"):
        parse_assignments(["fast=a", "fast=b"], option="--partition")
    with pytest.raises(LaunchError, match=r"--nodelist: not an island of the cluster \(got 'fats'\).*fast, slow"):
        placements_from_options(cluster, {}, {"fats": "n0"})
    with pytest.raises(LaunchError, match=r"not a Slurm name"):
        IslandPlacement(island="fast", partition="p0; rm -rf /")


def test_job_options_validation():
    with pytest.raises(LaunchError, match=r"--time: not a Slurm time limit \(got '2h'\)"):
        JobOptions(cluster_file="c", plan_file="p", time="2h")
    with pytest.raises(LaunchError, match=r"--master-port: must be between 1024 and 65535 \(got 80\)"):
        JobOptions(cluster_file="c", plan_file="p", master_port=80)
    with pytest.raises(LaunchError, match=r"--job-name"):
        JobOptions(cluster_file="c", plan_file="p", job_name="a b")
    assert JobOptions(cluster_file="c", plan_file="p", time="1-02:00:00").time == "1-02:00:00"


def test_island_environment():
    assert island_environment("cpu") == ()
    assert dict(island_environment("nvidia"))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    with pytest.raises(LaunchError, match="intel"):
        island_environment("intel")


def _golden_cases():
    cpu_cluster, cpu_plan = _cpu()
    gpu_cluster, gpu_plan = load_cluster(ROOT / GPU_CLUSTER), Plan.load(ROOT / GPU_PLAN)
    return {
        "cpu-demo.sbatch": render_sbatch(
            het_components(cpu_cluster, cpu_plan, placements_from_options(cpu_cluster, {"fast": "p0", "slow": "p1"}, {})),
            JobOptions(cluster_file=CPU_DEMO, plan_file=CPU_PLAN, training_args=tuple(DEMO_ARGS))),
        "a100-mi250x.sbatch": render_sbatch(
            het_components(gpu_cluster, gpu_plan, placements_from_options(
                gpu_cluster, {"a100-pod": "a100", "mi250-pod": "mi250x"}, {"mi250-pod": "amd01"})),
            JobOptions(cluster_file=GPU_CLUSTER, plan_file=GPU_PLAN, job_name="llama2-7b", time="04:00:00",
                       account="proj123", master_port=29500, log="logs/%x-%j.out",
                       training_args=("--num-layers", "32", "--tokenizer-model", "/data/tok model.json"))),
    }


@pytest.mark.parametrize("name", ["cpu-demo.sbatch", "a100-mi250x.sbatch"])
def test_golden_sbatch(name):
    text = _golden_cases()[name]
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended, and review the diff"
    subprocess.run(["bash", "-n", str(path)], check=True)  # valid shell


def test_golden_content_details():
    cpu, gpu = _golden_cases()["cpu-demo.sbatch"], _golden_cases()["a100-mi250x.sbatch"]
    assert cpu.count("#SBATCH hetjob") == 1 and gpu.count("#SBATCH hetjob") == 1
    assert "--gpus-per-node" not in cpu and gpu.count("#SBATCH --gpus-per-node=8") == 2
    assert "#SBATCH --nodelist=amd01" in gpu and "#SBATCH --nodes=3" in gpu
    assert "MEGATRON_HET_FIRST_NODE_RANK=3,CUDA_DEVICE_MAX_CONNECTIONS=1" in gpu
    assert "NNODES=4" in gpu and "MASTER_PORT=${MASTER_PORT:-29500}" in gpu
    assert "'/data/tok model.json'" in gpu  # training args are shell-quoted
    assert "SLURM_HET_JOB_ID" not in cpu.replace("SLURM_HET_JOB_ID is unset", "")
    assert "SLURM_JOB_NODELIST_HET_GROUP_0" in cpu and "--rdzv-backend=static" in cpu


def test_sharded_plan_components_come_from_rank_shares():
    cluster = load_cluster(ROOT / CPU_DEMO)
    shares = tuple(RankShare(rank=i, island="fast" if i < 2 else "slow", device_type="CPU", micro_batch_size=1,
                             num_micro_batches=2, shard_fraction=0.25) for i in range(4))
    comps = het_components(cluster, ShardedPlan(ranks=shares, global_batch_size=8), {})
    assert [(c.island, c.nodes, c.procs_per_node, c.first_rank) for c in comps] == [("fast", 1, 2, 0), ("slow", 1, 2, 2)]
    out_of_order = tuple(RankShare(rank=i, island="slow" if i < 2 else "fast", device_type="CPU", micro_batch_size=1,
                                   num_micro_batches=2, shard_fraction=0.25) for i in range(4))
    with pytest.raises(LaunchError, match=r"island fast.*must hold ranks 0\.\.1"):
        het_components(cluster, ShardedPlan(ranks=out_of_order, global_batch_size=8), {})


def test_network_interface_sets_gloo_and_nccl_socket_ifname():
    assert dict(island_environment("nvidia", network_interface="ib0"))["NCCL_SOCKET_IFNAME"] == "ib0"
    assert dict(island_environment("cpu", network_interface="eth1")) == {"GLOO_SOCKET_IFNAME": "eth1",
                                                                         "NCCL_SOCKET_IFNAME": "eth1"}
    data = yaml.safe_load((ROOT / CPU_DEMO).read_text())
    data["islands"][0]["network_interface"] = "lo"
    cluster = cluster_from_dict(data)
    _, plan = _cpu()
    script = render_sbatch(het_components(cluster, plan, {}), JobOptions(cluster_file="c.yaml", plan_file="p.json"))
    assert "MEGATRON_HET_FIRST_NODE_RANK=0,GLOO_SOCKET_IFNAME=lo,NCCL_SOCKET_IFNAME=lo" in script  # island fast
    assert script.count("SOCKET_IFNAME") == 2  # island slow names none: the libraries choose


def test_values_are_quoted_and_comments_hold_no_control_characters(tmp_path):
    cluster, plan = _cpu()
    comps = het_components(cluster, plan, placements_from_options(cluster, {}, {"fast": "n[0-0]"}))
    train = ("--data-path", "$(touch pwned)", "a b", "`touch pwned`;touch pwned")
    script = render_sbatch(comps, JobOptions(cluster_file="c\n$(touch pwned).yaml", plan_file="p\rx.json",
                                             training_args=train))
    lines = script.splitlines()
    assert lines[1] == "# Generated by tools/slurm.py from c\\n$(touch pwned).yaml and p\\rx.json; regenerate rather than edit."
    assert "#SBATCH --nodelist='n[0-0]'" in lines  # sbatch strips the quotes, as the shell would
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # The TRAIN array, evaluated by bash, holds every value literally and runs nothing.
    assignment = script[script.index("TRAIN=("):script.index("\n\n# Runs once per node")]
    out = subprocess.run(["bash", "-c", assignment + '\nprintf "%s\\0" "${TRAIN[@]}"'], cwd=tmp_path,
                         capture_output=True, check=True).stdout.decode()  # bytes: keep the \r
    assert out.split("\0")[:-1] == ["pretrain_scripts/pretrain_gpt.py", "--hetero-cluster", "c\n$(touch pwned).yaml",
                                    "--hetero-plan", "p\rx.json", *train]
    assert list(tmp_path.iterdir()) == []
