"""The first-job recipe of docs/gpu.md (section 5), read from the doc itself so that its tests run exactly
what a reader types: tests/gpu/test_harness_on_cpu.py checks the commands on CPU, and
tests/gpu/test_gpu_first_job.py runs them on 8 GPUs.

Each tested block of the doc follows a marker ``<!-- first-job: NAME [VENDOR] -->`` and is one fenced code
block: ``docker VENDOR``, ``data``, ``plan VENDOR``, ``plan-output VENDOR`` (the planner's printed output)
and ``train VENDOR``. Commands are one per line (a trailing backslash joins lines), relative to the
repository root (the image's ``/opt/megatron-het``), writing under ``runs/first-job/``.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO

DOC = REPO / "docs" / "gpu.md"
VENDORS = ("nvidia", "amd")
PRETRAIN_SCRIPT = "pretrain_scripts/pretrain_gpt.py"
LAUNCHER = ["python", "-m", "torch.distributed.run"]
# the repository folders the commands read; a work directory links them so the outputs land in it
INPUTS = ("examples", "tools", "pretrain_scripts")
# `python tools/X.py` -> the module whose main(argv) the shim runs (tools are thin shims over cli/)
TOOL_MODULES = {
    "tools/make_corpus.py": "megatron_het.cli.make_corpus",
    "tools/train_tokenizer.py": "megatron_het.cli.tokenizer",
    "tools/preprocess_data.py": "megatron_het.cli.preprocess",
    "tools/plan.py": "megatron_het.cli.plan",
}
_BLOCK = re.compile(r"<!-- first-job: ([a-z-]+)(?: ([a-z]+))? -->\n```[a-z]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class Recipe:
    vendor: str
    docker: list[list[str]]  # build, mkdir, run (on the host)
    data: list[list[str]]  # in the container
    plan: list[str]
    plan_output: str  # what the doc shows the planner printing
    train: list[str]

    @property
    def train_args(self) -> list[str]:
        """pretrain_gpt.py's own arguments (after the launcher and the script)."""
        return self.train[self.train.index(PRETRAIN_SCRIPT) + 1:]

    @property
    def nproc_per_node(self) -> int:
        launcher = self.train[:self.train.index(PRETRAIN_SCRIPT)]
        return int(launcher[launcher.index("--nproc-per-node") + 1])

    def flag(self, argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]


def blocks(text: str | None = None) -> dict[tuple[str, str | None], str]:
    text = DOC.read_text(encoding="utf-8") if text is None else text
    found: dict[tuple[str, str | None], str] = {}
    for name, vendor, body in _BLOCK.findall(text):
        key = (name, vendor or None)
        assert key not in found, f"docs/gpu.md: two first-job blocks named {key}"
        found[key] = body
    return found


def commands(block: str) -> list[list[str]]:
    """Shell lines of a block as argv lists (comments and blank lines dropped, continuations joined)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(argv)
    return out


def recipe(vendor: str) -> Recipe:
    b = blocks()
    missing = [k for k in (("docker", vendor), ("data", None), ("plan", vendor), ("plan-output", vendor),
                           ("train", vendor)) if k not in b]
    assert not missing, f"docs/gpu.md lacks the first-job blocks {missing}"
    (plan,), (train,) = commands(b[("plan", vendor)]), commands(b[("train", vendor)])
    return Recipe(vendor=vendor, docker=commands(b[("docker", vendor)]), data=commands(b[("data", None)]),
                  plan=plan, plan_output=b[("plan-output", vendor)], train=train)


def link_inputs(workdir: Path) -> Path:
    """``workdir`` with the repository's input folders linked in, so the commands run there unchanged
    and write their outputs (runs/first-job/...) under it rather than in the checkout."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in INPUTS:
        link = workdir / name
        if not link.exists():
            link.symlink_to(REPO / name, target_is_directory=True)
    return workdir


def run_in_process(argv: list[str]) -> int:
    """A data or plan command in this process (cwd = the work directory): ``mkdir -p`` or a tool's main."""
    if argv[:2] == ["mkdir", "-p"]:
        for path in argv[2:]:
            os.makedirs(path, exist_ok=True)
        return 0
    assert argv[0] == "python" and argv[1] in TOOL_MODULES, f"not a repository tool: {shlex.join(argv)}"
    return importlib.import_module(TOOL_MODULES[argv[1]]).main(argv[2:])


def subprocess_argv(argv: list[str]) -> list[str]:
    """The command as a subprocess runs it: ``python`` is this interpreter (the one with megatron-het)."""
    if argv[:2] == ["mkdir", "-p"]:
        return argv
    assert argv[0] == "python", f"expected a python command: {shlex.join(argv)}"
    return [sys.executable, *argv[1:]]


def plan_summary(output: str) -> dict[str, str]:
    """What the planner's output says of its choice: the layout line under ``Best:``, the schedule,
    the ranks and the mode (the predicted figures are left out)."""
    lines = output.splitlines()
    best = next(i for i, line in enumerate(lines) if line.startswith("Best:"))
    schedule = re.search(r"^Schedule: ([a-z0-9-]+),", output, re.M)
    micro = re.search(r"micro_batch_size (\d+)", lines[best])
    return {"layout": lines[best + 1].strip(), "schedule": schedule.group(1) if schedule else "",
            "micro_batch_size": micro.group(1) if micro else "",
            "ranks": next((line for line in lines if line.startswith("ranks: ")), ""),
            "mode": next((line.split(":")[1].strip() for line in lines if line.startswith("mode: ")), "")}
