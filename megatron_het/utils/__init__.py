"""Small helpers shared by the tools (no training logic here)."""

from megatron_het.utils.progress import Progress, ProgressCallback, add_progress_argument, format_progress

__all__ = ["Progress", "ProgressCallback", "add_progress_argument", "format_progress"]
