"""What ``pretrain_gpt.py --hetero-resilience`` and its knobs ask for, validated (stdlib only).

``arguments.py`` builds one ``ResilienceOptions`` from the flags; ``cli/pretrain.py`` turns
it into the hooks (``resilience/recovery.ResilienceHooks``). Kept free of torch and of the rest of the
package so the argument parser can import it without pulling the runtime in.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "reroute", "replan")  # --hetero-resilience-policy values


@dataclass(frozen=True, kw_only=True)
class FaultInjection:
    """Testing: SIGKILL original rank ``rank`` in 0-based ``iteration`` after ``after_actions`` actions."""

    rank: int  # original global rank that kills itself
    iteration: int  # 0-based iteration in which it dies
    after_actions: int = 1  # schedule actions it completes in that iteration first

    @classmethod
    def parse(cls, text: str) -> FaultInjection:
        """``RANK:ITERATION[:AFTER_ACTIONS]`` (non-negative integers; nothing else is accepted)."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--hetero-inject-fault: {text!r} is not RANK:ITERATION[:AFTER_ACTIONS] "
                             f"(non-negative integers). Fix: e.g. 3:1 kills rank 3 in iteration 1 (0-based)")
        return cls(rank=int(parts[0]), iteration=int(parts[1]), after_actions=int(parts[2]) if len(parts) > 2 else 1)


@dataclass(frozen=True, kw_only=True)
class ResilienceOptions:
    """In-process fault tolerance of a pretrain_gpt.py run (``--hetero-resilience``)."""

    store_host: str  # host of the resilience store (outside the training ranks; launchers start it)
    store_port: int  # its TCP port
    heartbeat_interval_s: float = 0.5  # --hetero-heartbeat-interval: seconds between a rank's heartbeats
    failure_timeout_s: float = 15.0  # --hetero-failure-timeout: a silent or stuck peer counts as failed after this
    policy: str = "auto"  # --hetero-resilience-policy: auto (simulator decides), reroute, replan
    report_dir: str | None = None  # --hetero-resilience-report: each rank writes rank{R}.json there at the end
    fault: FaultInjection | None = None  # --hetero-inject-fault (testing only)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--hetero-resilience-policy: {self.policy!r} is not one of {list(POLICIES)}. "
                             f"Fix: use auto (the simulator picks re-route or re-plan), reroute or replan")
        if not 0 < self.heartbeat_interval_s < self.failure_timeout_s:
            raise ValueError(f"--hetero-heartbeat-interval / --hetero-failure-timeout: need 0 < interval < timeout "
                             f"(got {self.heartbeat_interval_s} and {self.failure_timeout_s}). Fix: e.g. 0.5 and 15")
        if not 0 < self.store_port < 65536:
            raise ValueError(f"--hetero-resilience-store: port {self.store_port} is not in 1..65535. "
                             f"Fix: pass HOST:PORT of the store the launcher started")

    @property
    def agreement_timeout_s(self) -> float:
        """A peer that neither joins the agreement nor goes silent is declared failed after this."""
        return max(60.0, 4 * self.failure_timeout_s)

    def describe(self) -> str:
        """The start-up log line."""
        return (f"resilience: ON (in-process re-route/re-plan on rank failure; policy {self.policy}, heartbeat every "
                f"{self.heartbeat_interval_s:g} s, failure timeout {self.failure_timeout_s:g} s, store "
                f"{self.store_host}:{self.store_port})")


def parse_store(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) -> (host, port); ValueError naming the flag otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--hetero-resilience-store: {text!r} is not HOST:PORT. Fix: pass the address the "
                         f"launcher's store listens on, e.g. 10.0.0.1:29600 (python -m "
                         f"megatron_het.cli.resilience_store starts one)")
    return host, int(port)
