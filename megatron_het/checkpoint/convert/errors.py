"""The one exception type of checkpoint conversion."""

from __future__ import annotations

from megatron_het.errors import UserError


class ConvertError(UserError):
    """A checkpoint that cannot be converted; the message names the tensor or field and the fix."""
