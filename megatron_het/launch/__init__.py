"""Launching on Slurm: plan (either kind) + cluster -> heterogeneous-job sbatch script (pure functions).

``het_components`` decides the job's shape (one component per island the plan uses, nodes and
processes per node from the plan's ranks); ``render_sbatch`` writes the script. tools/slurm.py is
the CLI over both. Guide: docs/launch.md.
"""

from megatron_het.launch.environment import VENDOR_ENVIRONMENT, island_environment
from megatron_het.launch.errors import LaunchError
from megatron_het.launch.layout import (
    HetComponent,
    IslandPlacement,
    het_components,
    nodelist_size_hint,
    parse_assignments,
    placements_from_options,
    total_nodes,
)
from megatron_het.launch.model_args import check_job_flags, model_for_job
from megatron_het.launch.sbatch import DEFAULT_SCRIPT, JobOptions, render_sbatch

__all__ = [
    "DEFAULT_SCRIPT",
    "VENDOR_ENVIRONMENT",
    "HetComponent",
    "IslandPlacement",
    "JobOptions",
    "LaunchError",
    "check_job_flags",
    "het_components",
    "island_environment",
    "model_for_job",
    "nodelist_size_hint",
    "parse_assignments",
    "placements_from_options",
    "render_sbatch",
    "total_nodes",
]
