"""``--deterministic-mode`` as Megatron-LM applies it (``megatron/training/determinism.py``, shipped
in the same wheel): the collective and GEMM libraries' environment pinned to bit-reproducible
settings (``NCCL_ALGO=Ring``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``;
a launcher's own value is kept when it is one of the deterministic ones), torch's deterministic
algorithms on, and megatron-core's ``deterministic_mode`` in the layers' config. The libraries read
their variables when they first start, so this runs before the rendezvous. Megatron-LM asserts; here
an incompatible option or variable is a ConfigError naming it and the fix."""

from __future__ import annotations

import os

import torch

from megatron_het.cluster.errors import ConfigError

__all__ = ["apply_deterministic_mode"]


def apply_deterministic_mode(*, tp_comm_overlap: bool, env=None) -> str:
    """Pin ``env`` (default ``os.environ``) and torch to deterministic settings; the start-up line."""
    from megatron.training import determinism

    env = os.environ if env is None else env
    if tp_comm_overlap:  # Megatron-LM's ARG_VALUES_REQUIRED_FOR_DETERMINISM (no cross-entropy fusion here)
        raise ConfigError("--deterministic-mode cannot run with --tp-comm-overlap (its chunked collectives "
                          "overlap GEMMs in a varying order)", field="--tp-comm-overlap", value=True,
                          fix="drop --tp-comm-overlap or --deterministic-mode")
    accepted = {"NCCL_ALGO": determinism.ACCEPTED_NCCL_ALGO_TOKENS, **determinism.ACCEPTED_ENV_VAR_VALUES}

    def fits(name: str, value: str) -> bool:  # NCCL_ALGO is a comma-separated list of algorithms
        tokens = {t.strip() for t in value.split(",") if t.strip()} if name == "NCCL_ALGO" else {value}
        return bool(tokens) and tokens <= accepted[name]

    bad = [name for name in accepted if env.get(name) is not None and not fits(name, env[name])]
    if bad:
        name = bad[0]
        raise ConfigError("--deterministic-mode needs a deterministic setting of this environment variable",
                          field=name, value=env[name], fix=f"unset {name} ({determinism.DETERMINISM_ENV_VAR_DEFAULTS[name]}"
                          f" is then used) or set it to one of {sorted(accepted[name])}")
    determinism.apply_determinism_env(env)  # validates the rest (MAMBA_DETERMINISTIC) and fills the defaults
    torch.use_deterministic_algorithms(True)
    pinned = ", ".join(f"{k}={env[k]}" for k in determinism.DETERMINISM_ENV_VAR_DEFAULTS)
    return f"deterministic mode: torch deterministic algorithms on; {pinned}"
