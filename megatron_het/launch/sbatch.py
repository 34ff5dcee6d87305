"""Heterogeneous-job components -> an sbatch script (pure text rendering).

The script asks for one Slurm het-job component per island (``#SBATCH hetjob`` between them) and
starts one torchrun per node with ``srun --het-group=<n>``. Node ranks run over the components in
order, so global ranks come out island by island in cluster-file order, as the plan expects.

Rendezvous is ``static`` on the first node of component 0: with ``c10d`` torchrun ignores
``--node-rank`` and orders nodes by host name, which would scramble the islands' rank blocks.
Static rendezvous still lets each node start its own number of processes (torch elastic sums the
local world sizes of the nodes before it).

With ``--hetero-resilience`` among the training arguments, a dead rank must not end the job step:
the script starts the resilience store (``python -m megatron_het.cli.resilience_store``) on the
batch node, every rank gets its own torchrun agent (``--nproc-per-node=1 --max-restarts=0``:
torchrun's agent stops all its workers when one fails; one agent per rank stops only that rank,
measured), ``srun --kill-on-bad-exit=0`` keeps a step's other tasks running, and the script waits for
every component instead of stopping the others at the first failure.

Nothing from the cluster, plan or command line reaches the script unquoted: directive and
``--export=`` values go through ``shlex.quote`` (names are plain words already, cluster/ checks
them), training arguments become a quoted bash array, and comments have every control character
escaped, so no value can end a comment line or add a variable to an ``--export`` list.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_het.launch.errors import LaunchError
from megatron_het.launch.layout import HetComponent, total_nodes

DEFAULT_SCRIPT = "pretrain_scripts/pretrain_gpt.py"
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # Slurm --time forms: M, M:S, H:M:S, D-H, D-H:M:S
_PLAIN = re.compile(r"^[A-Za-z0-9_.%\-/+=:@]+$")  # sbatch directive values that need no quoting


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """Everything about the job that is not in the cluster or plan."""

    cluster_file: str  # path given to --hetero-cluster (relative paths: relative to the submit directory)
    plan_file: str  # path given to --hetero-plan
    training_args: tuple[str, ...] = ()  # Megatron-LM flags after the cluster and plan
    script: str = DEFAULT_SCRIPT  # training entry point torchrun starts
    job_name: str = "megatron-het"  # #SBATCH --job-name
    log: str = "%x-%j.out"  # #SBATCH --output (Slurm filename pattern)
    time: str | None = None  # #SBATCH --time, e.g. "02:00:00"; None: the partition's default
    account: str | None = None  # #SBATCH --account; None: the user's default
    master_port: int | None = None  # rendezvous port; None: 20000 + job id % 20000 (jobs sharing a node differ)
    source: str = "tools/slurm.py"  # named in the header comment

    def __post_init__(self) -> None:
        if self.time is not None and not _TIME.match(self.time):
            raise LaunchError(field="--time", value=self.time, problem="not a Slurm time limit",
                              fix="write minutes, HH:MM:SS or D-HH:MM:SS, e.g. --time 02:00:00")
        for name in ("job_name", "log", "account"):
            value = getattr(self, name)
            if value is not None and not _PLAIN.match(value):
                raise LaunchError(field=f"--{name.replace('_', '-')}", value=value,
                                  problem="contains characters sbatch directives cannot carry (spaces, quotes, $)",
                                  fix="use letters, digits and _ . % - / + = : @ only")
        if self.master_port is not None and not 1024 <= self.master_port <= 65535:
            raise LaunchError(field="--master-port", value=self.master_port,
                              problem="must be between 1024 and 65535",
                              fix="pick an unprivileged free port, e.g. 29500, or leave it out")


def _q(value: object) -> str:
    """A shell word for ``value`` (sbatch strips the same quotes from #SBATCH directives)."""
    return shlex.quote(str(value))


def _comment(text: str) -> str:
    """``text`` with control characters escaped: a newline would end the comment and start a command."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _export_list(c: HetComponent) -> str:
    """The srun --export value; a comma inside a value would start another variable, so none may have one."""
    exports = [("MEGATRON_HET_ISLAND", c.island), ("MEGATRON_HET_NPROC", str(c.procs_per_node)),
               ("MEGATRON_HET_FIRST_NODE_RANK", str(c.first_node_rank)), *c.environment]
    for name, value in exports:
        if "," in value or not value.isprintable():
            raise LaunchError(field=f"environment {name}", value=value,
                              problem="srun --export cannot carry a comma or control character in a value",
                              fix="rename the island or interface with letters, digits, _ . - only")
    return ",".join(["ALL"] + [f"{k}={v}" for k, v in exports])


def _directives(c: HetComponent) -> list[str]:
    lines = []
    if c.partition:
        lines.append(f"#SBATCH --partition={_q(c.partition)}")
    if c.nodelist:
        lines.append(f"#SBATCH --nodelist={_q(c.nodelist)}")
    lines += [f"#SBATCH --nodes={c.nodes}", "#SBATCH --ntasks-per-node=1"]
    if c.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    return lines


def _describe(c: HetComponent) -> str:
    last_node = c.first_node_rank + c.nodes - 1
    return _comment(f"#   component {c.index}: island {c.island} ({c.device_type}, {c.vendor}): {c.nodes} node(s) x "
                    f"{c.procs_per_node} ranks, node ranks {c.first_node_rank}-{last_node}, "
                    f"global ranks {c.first_rank}-{c.first_rank + c.num_ranks - 1}")


RESILIENCE_FLAG = "--hetero-resilience"  # in the training arguments: the job step survives a dead rank


def _srun(c: HetComponent, *, resilient: bool = False) -> list[str]:
    return [
        _comment(f"# component {c.index}: island {c.island}"),
        f"srun --het-group={c.index} --nodes={c.nodes} --ntasks-per-node=1 --kill-on-bad-exit={0 if resilient else 1} \\",
        f"  --export={_q(_export_list(c))} \\",
        '  bash -c "$NODE_CMD" torchrun "${TRAIN[@]}" &',
        "pids+=($!)",
    ]


def render_sbatch(components: Sequence[HetComponent], options: JobOptions) -> str:
    """The whole sbatch script text (ends with a newline)."""
    if not components:
        raise LaunchError(field="plan", value=[], problem="the plan places no ranks on any island",
                          fix="pass a plan with at least one stage")
    o = options
    header = [
        "#!/bin/bash",
        _comment(f"# Generated by {o.source} from {o.cluster_file} and {o.plan_file}; regenerate rather than edit."),
        f"# Slurm heterogeneous job, one component per island the plan uses ({total_nodes(components)} nodes, "
        f"{sum(c.num_ranks for c in components)} ranks):",
        *(_describe(c) for c in components),
        "# Submit: sbatch THIS_FILE (from the directory the paths below are relative to).",
        f"#SBATCH --job-name={_q(o.job_name)}",
        f"#SBATCH --output={_q(o.log)}",
    ]
    if o.time:
        header.append(f"#SBATCH --time={_q(o.time)}")
    if o.account:
        header.append(f"#SBATCH --account={_q(o.account)}")
    for c in components:
        if c.index:
            header.append("#SBATCH hetjob")
        header += _directives(c)

    port = str(o.master_port) if o.master_port else "$((20000 + SLURM_JOB_ID % 20000))"
    train = [o.script, "--hetero-cluster", o.cluster_file, "--hetero-plan", o.plan_file, *o.training_args]
    resilient = RESILIENCE_FLAG in o.training_args
    if resilient:
        return _render_resilient(header, components, port, train)
    body = [
        *_rendezvous_lines(port),
        "TORCHRUN=${TORCHRUN:-torchrun}  # e.g. TORCHRUN=\"python -m torch.distributed.run\" sbatch ...",
        f"NNODES={total_nodes(components)}",
        "export MASTER_ADDR MASTER_PORT TORCHRUN NNODES",
        'echo "megatron-het: job $SLURM_JOB_ID, ${SLURM_HET_SIZE:-1} components, $NNODES nodes, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "TRAIN=(" + " ".join(shlex.quote(a) for a in train) + ")",
        "",
        "# Runs once per node; SLURM_NODEID is the node's index inside its component's step.",
        "NODE_CMD='exec $TORCHRUN --nnodes=\"$NNODES\" --nproc-per-node=\"$MEGATRON_HET_NPROC\" "
        "--node-rank=$((MEGATRON_HET_FIRST_NODE_RANK + SLURM_NODEID)) --rdzv-backend=static "
        "--rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" --rdzv-id=\"$SLURM_JOB_ID\" \"$@\"'",
        "",
        "pids=()",
    ]
    for c in components:
        body += _srun(c)
    body += [
        "",
        "# The first failing component stops the others: their ranks would wait in collectives forever.",
        "status=0",
        'for _ in "${pids[@]}"; do',
        "  rc=0; wait -n || rc=$?",
        '  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then',
        "    status=$rc",
        '    echo "megatron-het: a component exited with $rc; stopping the others" >&2',
        '    kill "${pids[@]}" 2>/dev/null || true',
        "  fi",
        "done",
        'exit "$status"',
    ]
    return "\n".join(header + [""] + body) + "\n"


def _rendezvous_lines(port: str) -> list[str]:
    """The script's start, shared by the plain and the resilient job: strict mode and the rendezvous address."""
    return [
        "set -euo pipefail",
        "",
        "# Inside a het job SLURM_HET_JOB_ID is unset; SLURM_JOB_ID and the *_HET_GROUP_<n> variables describe it.",
        "# The rendezvous runs on the first node of component 0, at the address Slurm knows it by (NodeAddr).",
        'MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)',
        'MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node "$MASTER_NODE" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')}',
        "MASTER_ADDR=${MASTER_ADDR:-$MASTER_NODE}",
        f"MASTER_PORT=${{MASTER_PORT:-{port}}}",
    ]


def _render_resilient(header: list[str], components: Sequence[HetComponent], port: str, train: list[str]) -> str:
    """The script of a ``--hetero-resilience`` run (see the module docstring)."""
    ranks = sum(c.num_ranks for c in components)
    store_given = "--hetero-resilience-store" in train
    body = [
        *_rendezvous_lines(port),
        "RESILIENCE_PORT=${RESILIENCE_PORT:-$((MASTER_PORT + 1))}",
        "TORCHRUN=${TORCHRUN:-torchrun}  # e.g. TORCHRUN=\"python -m torch.distributed.run\" sbatch ...",
        "PYTHON=${PYTHON:-python}",
        f"NNODES={ranks}  # --hetero-resilience: one torchrun agent per rank, each its own rendezvous node",
        "export MASTER_ADDR MASTER_PORT TORCHRUN NNODES",
        'echo "megatron-het: job $SLURM_JOB_ID, ${SLURM_HET_SIZE:-1} components, $NNODES ranks, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT, resilience store $MASTER_ADDR:$RESILIENCE_PORT"',
        "",
        "# The resilience store (heartbeats, agreement, rebuilt worlds) outlives every rank: it runs here, on the",
        "# batch node (the first node of component 0), listening on the rendezvous address only.",
        '"$PYTHON" -m megatron_het.cli.resilience_store --host "$MASTER_ADDR" --port "$RESILIENCE_PORT" &',
        "STORE_PID=$!",
        'trap \'kill "$STORE_PID" 2>/dev/null || true\' EXIT',
        "",
        "TRAIN=(" + " ".join(shlex.quote(a) for a in train) + ")",
    ]
    if not store_given:
        body.append('TRAIN+=(--hetero-resilience-store "$MASTER_ADDR:$RESILIENCE_PORT")')
    body += [
        "",
        "# Runs once per node: one torchrun agent per rank (--max-restarts=0: a dead rank is not restarted, the",
        "# others keep training in-process); the node's exit status is its worst rank's. Each agent's LOCAL_RANK",
        "# is 0 (one process per agent), so MEGATRON_HET_LOCAL_RANK tells each rank its GPU on the node.",
        "NODE_CMD='first=$((MEGATRON_HET_FIRST_RANK + SLURM_NODEID * MEGATRON_HET_NPROC)); agents=(); "
        "for ((i = 0; i < MEGATRON_HET_NPROC; i++)); do "
        "MEGATRON_HET_LOCAL_RANK=$i $TORCHRUN --nnodes=\"$NNODES\" --nproc-per-node=1 --max-restarts=0 "
        "--node-rank=$((first + i)) "
        "--rdzv-backend=static --rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" --rdzv-id=\"$SLURM_JOB_ID\" \"$@\" & "
        "agents+=($!); done; rc=0; for a in \"${agents[@]}\"; do wait \"$a\" || rc=$?; done; exit $rc'",
        "",
        "pids=()",
    ]
    for c in components:
        lines = _srun(c, resilient=True)
        lines[2] = f"  --export={_q(_export_list(c) + f',MEGATRON_HET_FIRST_RANK={c.first_rank}')} \\"
        body += lines
    body += [
        "",
        "# --hetero-resilience: a component whose rank died is not a reason to stop the others; wait for all.",
        "status=0",
        'for pid in "${pids[@]}"; do',
        '  rc=0; wait "$pid" || rc=$?',
        '  if [ "$rc" -ne 0 ]; then echo "megatron-het: a component exited with $rc (a rank died; the others '
        'continued)" >&2; status=$rc; fi',
        "done",
        'exit "$status"',
    ]
    return "\n".join(header + [""] + body) + "\n"
