"""Whether this process was started by a launcher (torchrun, ``python -m torch.distributed.run``).

``pretrain_scripts/pretrain_gpt.py`` joins the process group through the ``env://`` rendezvous; run
with plain ``python`` it ended in torch's traceback (``environment variable RANK expected, but not
set``). ``launcher_error`` says it in one line instead, with the number of processes the plan needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# what torch's env:// rendezvous reads (torchrun sets all of them)
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def missing_rendezvous(environ: Mapping[str, str] | None = None) -> list[str]:
    """The rendezvous variables absent from ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return [name for name in RENDEZVOUS_VARIABLES if name not in environ]


def launcher_error(ranks: int, missing: list[str], *, script: str = "pretrain_scripts/pretrain_gpt.py") -> str:
    """One line: not started by a launcher (``missing`` variables), launch with one process per rank
    of the plan (``ranks``)."""
    return (f"not started by a launcher ({', '.join(missing)} not set): launch with torchrun --nproc-per-node "
            f"{ranks} {script} ... (the plan has {ranks} ranks; without the torchrun command: "
            "python -m torch.distributed.run)")
