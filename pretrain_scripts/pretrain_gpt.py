"""Megatron-style GPT pre-training on a heterogeneous cluster.

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py \
        --hetero-cluster examples/clusters/cpu-demo.yaml --hetero-plan examples/plans/cpu-demo-hetero.json \
        --hetero-model examples/models/tiny-cpu.yaml --micro-batch-size 2 --global-batch-size 16 \
        --train-iters 20 --mock-data

Thin: everything lives in megatron_het.cli.pretrain (parse, build, train, close). Started without
torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT not set), it still reports bad arguments and plans
as the run would, then says how to launch in one line (exit 2) instead of torch's rendezvous traceback.
"""

import sys


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from megatron_het.cli.pretrain import main as pretrain_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not dist.is_initialized():
        from megatron_het.launch.torchrun import missing_rendezvous

        missing = missing_rendezvous()
        if missing:
            return not_launched(argv, missing)
    return pretrain_main(argv)


def not_launched(argv: list[str], missing: list[str]) -> int:
    """The argument and plan checks of the run (their errors first), then the launch line; exit 2."""
    from megatron_het.cli.pretrain import resolve_plan
    from megatron_het.errors import UserError
    from megatron_het.launch.torchrun import launcher_error
    from megatron_het.runtime.arguments import parse_args

    try:
        plan = resolve_plan(parse_args(argv))
    except UserError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    print(f"pretrain_gpt.py: error: {launcher_error(plan.world_size, missing)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
