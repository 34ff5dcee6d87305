"""The one exception type of checkpoint conversion."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or field and the fix."""
