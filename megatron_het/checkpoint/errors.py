"""The checkpoint package's error for checkpoints that cannot be used (bad, foreign or unsafe)."""

from __future__ import annotations

from megatron_het.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be used here; the message names the file or field and the fix."""
