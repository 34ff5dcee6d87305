"""tools/slurm.py (megatron_het.cli.slurm.main): plans of both kinds become jobs; bad input is one line.

The generated scripts are run for real with stand-ins for Slurm's ``srun``/``scontrol`` and for
torchrun (tiny shell scripts on PATH that record what they receive), so the tests see exactly which
arguments and environment a rank would get: nothing from a cluster file or a training flag is
executed, and every value arrives literally.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_het.cli import plan as plan_cli
from megatron_het.cli import slurm
from megatron_het.plan import Plan, ShardedPlan, load_any_plan
from megatron_het.runtime.arguments import parse_args

from support.paths import EXAMPLES, REPO

CPU_DEMO = str(EXAMPLES / "clusters" / "cpu-demo.yaml")
CPU_PAIR = str(EXAMPLES / "clusters" / "cpu-pair.yaml")
TINY = str(EXAMPLES / "models" / "tiny-cpu.yaml")
DEMO_PLAN = str(EXAMPLES / "plans" / "cpu-demo-hetero.json")

_SRUN = """\
#!/bin/bash
# srun stand-in: apply --export=ALL,K=V,... then run the command once, as node 0 of the step.
while [[ "$1" == --* ]]; do
  if [[ "$1" == --export=* ]]; then
    IFS=, read -ra pairs <<< "${1#--export=}"
    for pair in "${pairs[@]}"; do [[ "$pair" == ALL ]] || export "$pair"; done
  fi
  shift
done
SLURM_NODEID=0 exec "$@"
"""
_SCONTROL = """\
#!/bin/bash
# scontrol stand-in: one host, reachable on loopback.
if [[ "$2" == hostnames ]]; then echo node0; else echo "NodeName=node0 NodeAddr=127.0.0.1 State=IDLE"; fi
"""
_TORCHRUN = """\
#!/bin/bash
# torchrun stand-in: record the arguments (NUL-separated) and the socket interface, per island.
printf '%s\\0' "$@" > "$RECORD_DIR/$MEGATRON_HET_ISLAND.args"
echo "${GLOO_SOCKET_IFNAME:-unset} ${NCCL_SOCKET_IFNAME:-unset}" > "$RECORD_DIR/$MEGATRON_HET_ISLAND.ifname"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def dry_run(script: Path, work: Path) -> dict[str, list[str]]:
    """Run ``script`` with Slurm and torchrun stood in; island -> the arguments its torchrun received."""
    stubs, record = work / "stubs", work / "record"
    stubs.mkdir()
    record.mkdir()
    _executable(stubs / "srun", _SRUN)
    _executable(stubs / "scontrol", _SCONTROL)
    torchrun = _executable(stubs / "torchrun-recorder", _TORCHRUN)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "node0", "TORCHRUN": str(torchrun), "RECORD_DIR": str(record)}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    subprocess.run(["bash", str(script)], cwd=work, env=env, check=True, capture_output=True, timeout=60)
    return {p.stem: p.read_bytes().decode().split("\0")[:-1] for p in sorted(record.glob("*.args"))}


def _training_args(recorded: list[str]) -> list[str]:
    """pretrain_gpt.py's argv: what follows the script path in torchrun's arguments."""
    return recorded[recorded.index("pretrain_scripts/pretrain_gpt.py") + 1:]


def _one_error_line(capsys, *names: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and out == "", err
    assert "Traceback" not in err and any(name in lines[0] for name in names), lines[0]
    return lines[0]


# cpu-pair's sharded plan is asked for by mode: since the planner prices ZB-H1 on every layout (#19), auto
# picks a ZB-H1 pipeline there (1.04x); which mode auto picks is tests/unit/planner/test_planner_modes.py's
@pytest.mark.parametrize(("cluster", "mode", "kind"), [(CPU_DEMO, "auto", Plan), (CPU_PAIR, "sharded", ShardedPlan)])
def test_planned_plans_of_either_kind_become_a_job_pretrain_gpt_accepts(tmp_path, cluster, mode, kind):
    plan_file = tmp_path / "plan.json"
    assert plan_cli.main(["--cluster", cluster, "--model", TINY, "--global-batch-size", "16", "--mode", mode,
                          "--no-progress", "--output", str(plan_file)]) == 0
    plan = load_any_plan(plan_file)
    assert type(plan) is kind  # each cluster gets the kind the test means to cover
    mbs = plan.micro_batch_size if kind is Plan else plan.ranks[0].micro_batch_size
    job = tmp_path / "job.sbatch"
    train = ["--hetero-model", TINY, "--micro-batch-size", str(mbs), "--global-batch-size", "16",
             "--train-iters", "1", "--mock-data", "--lr", "1e-3"]
    assert slurm.main(["--cluster", cluster, "--plan", str(plan_file), "--output", str(job), "--", *train]) == 0
    subprocess.run(["bash", "-n", str(job)], check=True)
    recorded = dry_run(job, tmp_path)
    assert sorted(recorded) == ["fast", "slow"]  # one component per island
    ranks = plan.island_ranks()
    for island, argv in recorded.items():
        assert f"--nproc-per-node={len(ranks[island])}" in argv
        assert f"--node-rank={0 if island == 'fast' else 1}" in argv and "--rdzv-backend=static" in argv
        args = parse_args(_training_args(argv))  # pretrain_gpt.py's own parser
        assert args.plan_source == str(plan_file) and args.model.num_layers == 4
        again = load_any_plan(args.plan_source)
        again.validate(args.model, args.cluster)  # what pretrain_gpt.py checks at start-up
        assert again == plan


def test_island_name_injection_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load(Path(CPU_DEMO).read_text())
    evil = "fast\nsrun touch pwned\n$(touch pwned),LD_PRELOAD=/tmp/evil.so"
    data["islands"][0]["name"] = evil
    data["links"][0]["between"] = [evil, "slow"]
    data["emulation"] = None
    Path("evil.yaml").write_text(yaml.safe_dump(data))
    rc = slurm.main(["--cluster", "evil.yaml", "--plan", DEMO_PLAN, "--output", "job.sbatch", "--", "--hetero-model",
                     TINY])
    assert rc == 2
    line = _one_error_line(capsys, "evil.yaml")
    assert line.startswith("slurm.py: evil.yaml: islands[0].name: must be 1-64 letters, digits, '_', '.' or '-'")
    assert sorted(os.listdir(tmp_path)) == ["evil.yaml"]  # no job, no pwned


def test_passthrough_command_substitution_arrives_literally(tmp_path):
    job = tmp_path / "job.sbatch"
    odd = ["--data-path", "$(touch pwned)", "--tokenizer-model", "`touch pwned`; touch pwned", "--split", "a b'c"]
    assert slurm.main(["--cluster", CPU_DEMO, "--plan", DEMO_PLAN, "--output", str(job), "--",
                       "--hetero-model", TINY, *odd]) == 0
    recorded = dry_run(job, tmp_path)
    for argv in recorded.values():
        assert _training_args(argv)[-len(odd):] == odd
    assert not list(tmp_path.rglob("pwned"))


def test_network_interface_reaches_the_ranks(tmp_path):
    data = yaml.safe_load(Path(CPU_DEMO).read_text())
    data["islands"][1]["network_interface"] = "lo"
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump(data))
    job = tmp_path / "job.sbatch"
    assert slurm.main(["--cluster", str(cluster), "--plan", DEMO_PLAN, "--model", TINY, "--output", str(job)]) == 0
    dry_run(job, tmp_path)
    assert (tmp_path / "record" / "slow.ifname").read_text() == "lo lo\n"
    assert (tmp_path / "record" / "fast.ifname").read_text() == "unset unset\n"


def _plan_with_missing_layer(path: Path) -> Path:
    data = json.loads(Path(DEMO_PLAN).read_text())
    data["replicas"][0]["stages"][0]["layers"] = [0, 2]  # layer 2 held by no stage
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("case", "names", "needle"), [
    ("missing-layer", ("bad-plan.json",), "bad-plan.json: replicas[0].stages[1].layers: starts at layer 3 but the "
                                          "previous stage stopped at 2 (layers missing)"),
    ("no-model", ("--model",), "--model: the plan must be checked against the model"),
    ("model-flag-not-int", ("--num-layers",), "--num-layers: expected an integer (got 'four')"),
    ("wrong-layer-count", ("--num-layers", "layers"), "the last stage stops at layer 4 but the model has num_layers=8"),
    ("output-exists", ("--output",), "--output: the file exists (it is kept)"),
    ("output-directory", ("--output",), "--output: is a directory"),
    ("output-parent-missing", ("--output",), "does not exist"),
    ("partition-unsafe", ("--partition",), "not a Slurm name"),
    ("plan-garbage", ("garbage.json",), "invalid JSON"),
])
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, monkeypatch, case, names, needle):
    monkeypatch.chdir(tmp_path)
    plan, output, train, extra = DEMO_PLAN, "job.sbatch", ["--hetero-model", TINY], []
    if case == "missing-layer":
        plan = str(_plan_with_missing_layer(tmp_path / "bad-plan.json"))
    elif case == "no-model":
        train = ["--train-iters", "3"]
    elif case == "model-flag-not-int":
        train += ["--num-layers", "four"]
    elif case == "wrong-layer-count":
        train += ["--num-layers=8"]
    elif case == "output-exists":
        Path(output).write_text("keep me\n")
    elif case == "output-directory":
        Path(output).mkdir()
    elif case == "output-parent-missing":
        output = "no/such/dir/job.sbatch"
    elif case == "partition-unsafe":
        extra = ["--partition", "fast=p0;touch pwned"]
    elif case == "plan-garbage":
        plan = "garbage.json"
        Path(plan).write_bytes(b"\x00{not json")
    before = {p: (p.stat().st_mtime_ns, p.is_dir()) for p in tmp_path.rglob("*")}
    rc = slurm.main(["--cluster", CPU_DEMO, "--plan", plan, "--output", output, *extra, "--", *train])
    assert rc == 2
    assert needle in _one_error_line(capsys, *names)
    assert {p: (p.stat().st_mtime_ns, p.is_dir()) for p in tmp_path.rglob("*")} == before


def test_output_is_replaced_only_with_force_atomically_and_executable(tmp_path, capsys):
    job = tmp_path / "job.sbatch"
    job.write_text("old\n")
    base = ["--cluster", CPU_DEMO, "--plan", DEMO_PLAN, "--model", TINY, "--output", str(job)]
    assert slurm.main(base) == 2 and job.read_text() == "old\n"
    capsys.readouterr()
    assert slurm.main([*base, "--force"]) == 0
    assert job.read_text().startswith("#!/bin/bash\n") and os.access(job, os.X_OK)
    assert stat.S_IMODE(job.stat().st_mode) == 0o755
    assert sorted(os.listdir(tmp_path)) == ["job.sbatch"]  # no temporary file left behind
    assert capsys.readouterr().err == f"wrote {job}\n"


def test_stdout_when_no_output_is_given(capsys):
    assert slurm.main(["--cluster", CPU_DEMO, "--plan", DEMO_PLAN, "--model", TINY, "--partition", "fast=p0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --partition=p0" in out


def test_shim_runs_from_any_directory(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "slurm.py"), "--cluster", CPU_DEMO, "--plan",
                             DEMO_PLAN, "--", "--hetero-model", TINY], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("#SBATCH hetjob") == 1


# A new-user review: each of these wrote a script (exit 0) that failed only after the job waited in the queue.
@pytest.mark.parametrize(("extra", "train", "needle"), [
    ([], ["--micro-batch-size", "4", "--global-batch-size", "16"],
     "--micro-batch-size: differs from the plan's micro_batch_size 2"),
    ([], ["--micro-batch-size=2", "--global-batch-size=32"],
     "--global-batch-size: differs from the plan's global_batch_size 16"),
    (["--model", TINY], ["--hetero-model", "other.yaml"], "--hetero-model: differs from --model"),
])
def test_passthrough_that_pretrain_gpt_would_refuse_is_refused_now(tmp_path, capsys, monkeypatch, extra, train,
                                                                     needle):
    monkeypatch.chdir(tmp_path)
    Path("other.yaml").write_text(Path(TINY).read_text().replace("num_layers: 4", "num_layers: 4\nffn_hidden_size: 128"))
    train = train if "--hetero-model" in train else ["--hetero-model", TINY, *train]
    rc = slurm.main(["--cluster", CPU_DEMO, "--plan", DEMO_PLAN, *extra, "--output", "job.sbatch", "--", *train])
    assert rc == 2
    line = _one_error_line(capsys, "--")
    assert needle in line and "Fix: " in line
    assert sorted(os.listdir(tmp_path)) == ["other.yaml"]


def test_same_model_under_another_path_is_accepted(tmp_path, capsys):
    copy = tmp_path / "copy.yaml"
    copy.write_text(Path(TINY).read_text().replace("name: tiny-cpu", "name: my-copy"))
    assert slurm.main(["--cluster", CPU_DEMO, "--plan", DEMO_PLAN, "--model", TINY, "--", "--hetero-model",
                       str(copy), "--micro-batch-size", "2", "--global-batch-size", "16"]) == 0


def test_plan_that_does_not_fit_device_memory_is_refused(tmp_path, capsys):
    data = yaml.safe_load(Path(CPU_DEMO).read_text())
    data["device_types"] = [{"name": "CPU", "memory_gib": 1}]  # the tiny model needs ~1.5 GiB per rank
    cluster = tmp_path / "small.yaml"
    cluster.write_text(yaml.safe_dump(data))
    rc = slurm.main(["--cluster", str(cluster), "--plan", DEMO_PLAN, "--model", TINY,
                     "--output", str(tmp_path / "job.sbatch")])
    assert rc == 2
    line = _one_error_line(capsys, "stages[0]")
    assert "replicas[0].stages[0]: does not fit device memory (1 GiB per CPU on island fast)" in line
    assert "Fix: re-plan" in line
    assert sorted(os.listdir(tmp_path)) == ["small.yaml"]


def test_the_memory_check_prices_the_plan_as_the_jobs_flags_run_it(tmp_path, capsys):
    """--use-distributed-optimizer shards the Adam state and --overlap-grad-reduce keeps the buckets'
    gradient copies: with the device's memory between the two predictions, the flags after -- decide."""
    import dataclasses

    from megatron_het.cluster import load_cluster, load_model
    from megatron_het.perf.predict import predict
    from megatron_het.plan import load_any_plan

    plan, model = load_any_plan(str(Path(DEMO_PLAN).parent / "cpu-demo-2replicas.json")), load_model(TINY)
    plan = dataclasses.replace(plan, use_distributed_optimizer=False, overlap_grad_reduce=False, predicted=None)
    plain_file = tmp_path / "plain.json"
    plain_file.write_text(plan.to_json())
    gib = {name: predict(dataclasses.replace(plan, **kw), model, load_cluster(CPU_DEMO)).memory_gib_per_rank_max
           for name, kw in (("plain", {}), ("sharded", {"use_distributed_optimizer": True}),
                            ("overlap", {"overlap_grad_reduce": True}))}
    assert gib["sharded"] < gib["plain"] < gib["overlap"]
    data = yaml.safe_load(Path(CPU_DEMO).read_text())
    for between, fits, refused in ((("sharded", "plain"), ["--use-distributed-optimizer"], []),
                                   (("plain", "overlap"), [], ["--overlap-grad-reduce"])):
        data["device_types"] = [{"name": "CPU", "memory_gib": (gib[between[0]] + gib[between[1]]) / 2}]
        cluster = tmp_path / "edge.yaml"
        cluster.write_text(yaml.safe_dump(data))
        common = ["--cluster", str(cluster), "--plan", str(plain_file), "--model", TINY, "--"]
        assert slurm.main(common + fits) == 0, capsys.readouterr().err
        capsys.readouterr()
        if refused:
            assert slurm.main(common + refused) == 2
            assert "does not fit device memory" in capsys.readouterr().err
        else:  # without the flag the unsharded state does not fit
            assert slurm.main(common) == 2
            assert "does not fit device memory" in capsys.readouterr().err
