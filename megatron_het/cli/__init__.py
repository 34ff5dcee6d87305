"""Every command-line tool's ``main(argv) -> int``: argument parsing and printing only, the logic
lives in the packages. Installed as console scripts (``megatron-het-plan``, ...) and reachable
through the thin shims in tools/ so that README commands keep working."""

import warnings

from megatron_het.platform import install_triton_guard

# Tools that reach megatron-core (convert, profile_host) must import it on machines without triton,
# whichever module imports it first; and its import-time notice that Transformer Engine and Apex are
# absent (its local fallbacks are used, see README "What runs where") is not the tool's output: an
# error must stay one line on stderr.
install_triton_guard()
warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed", category=UserWarning)
