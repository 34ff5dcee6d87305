"""Every command-line tool's ``main(argv) -> int``: argument parsing and printing only, the logic
lives in the packages. Installed as console scripts (``megatron-het-plan``, ...) and reachable
through the thin shims in tools/ so that README commands keep working."""
