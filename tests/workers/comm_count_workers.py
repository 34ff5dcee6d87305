"""Rank function of the communicator-count test: pretrain_gpt.py's ``run``, its log captured."""

from __future__ import annotations


def run_logs_worker(rank, world_size, argvs, plan):
    """For each argv: pretrain_gpt.py's ``run`` of ``plan``; the text it printed on this rank."""
    import contextlib
    import io

    from megatron_het.cli.pretrain import run
    from megatron_het.platform import detect_accelerator, enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args
    from megatron_het.runtime.communicators import communicator_count

    enable_cpu_backend()
    logs = []
    for argv in argvs:
        before = communicator_count()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            run(parse_args(argv), detect_accelerator(), plan=plan)
        logs.append((buf.getvalue(), before))
    return logs
