"""Failure detection and agreement through a rendezvous store that outlives any training rank.

Detection has two sources: a collective or point-to-point call that raises (gloo closes every
pair of a context when a peer's socket drops, so all survivors see an error within about a second
of a SIGKILL; a hung peer is caught by the process-group timeout), and heartbeats each rank writes
to the store (``hb/{rank}`` = wall time, every ``interval_s``). Agreement: each survivor that caught
an error announces itself for the generation, then waits until every member has either announced
itself or let its heartbeat go stale; the first to finish writes the decision with an atomic
compare-and-set, and everybody adopts that decision. A member that never announces itself is
declared failed after ``timeout_s`` even if it still beats (it is stuck), so the decision comes
within ``max(heartbeat_timeout_s, time for every survivor to hit an error) <= timeout_s``.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class StoreAddress:
    """Where the rendezvous store listens; it must live outside the training ranks (e.g. the launcher)."""

    host: str  # host name or IP of the store
    port: int  # TCP port of the store

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in 1..65535 (got {self.port}). Fix: pass the store's TCP port")

    def connect(self, timeout_s: float = 30.0) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """What the survivors decided about one failure generation."""

    generation: int  # 1 for the first failure, 2 for the second, ...
    failed: tuple[int, ...]  # original ranks declared failed in this generation (new ones only)
    iteration: int  # the iteration every survivor was in (it is redone)
    decided_by: int  # original rank that wrote the decision
    waited_s: float  # time this rank spent in the agreement


class AgreementError(RuntimeError):
    """The survivors cannot agree (they are in different iterations, or the store is gone)."""


class Heartbeat:
    """Background thread writing ``hb/{rank}`` = time.time() every ``interval_s`` (own store client)."""

    def __init__(self, address: StoreAddress, rank: int, *, interval_s: float = 0.5, prefix: str = "") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0 (got {interval_s}). Fix: use e.g. 0.5 seconds")
        self.address, self.rank, self.interval_s = address, rank, interval_s
        self._stop = threading.Event()
        self._store = dist.PrefixStore(prefix, address.connect()) if prefix else address.connect()
        self._store.set(f"hb/{rank}", repr(time.time()))
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.set(f"hb/{self.rank}", repr(time.time()))
            except Exception:  # store gone: the launcher is ending the job
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)


def last_heartbeat(store: dist.Store, rank: int) -> float:
    """Wall time of ``rank``'s last heartbeat (0.0 if it never wrote one)."""
    key = f"hb/{rank}"
    if not store.check([key]):
        return 0.0
    return float(store.get(key).decode())


def agree_on_failures(store: dist.Store, *, generation: int, rank: int, members: Sequence[int], iteration: int,
                      heartbeat_timeout_s: float = 5.0, timeout_s: float = 60.0, poll_s: float = 0.05) -> Agreement:
    """Announce this rank as alive in ``generation`` and return the agreed set of failed members."""
    if heartbeat_timeout_s <= 0 or timeout_s < heartbeat_timeout_s:
        raise ValueError(f"heartbeat_timeout_s/timeout_s: need 0 < heartbeat_timeout_s <= timeout_s (got "
                         f"{heartbeat_timeout_s} and {timeout_s}). Fix: e.g. 5 and 60 seconds")
    start = time.time()
    prefix = f"agree/{generation}"
    store.set(f"{prefix}/here/{rank}", str(iteration))
    decision_key = f"{prefix}/decision"
    while True:
        if store.check([decision_key]):
            break
        now = time.time()
        here, dead, unknown = [], [], []
        for m in members:
            if store.check([f"{prefix}/here/{m}"]):
                here.append(m)
            elif now - last_heartbeat(store, m) > heartbeat_timeout_s or now - start > timeout_s:
                dead.append(m)
            else:
                unknown.append(m)
        if not unknown:
            iterations = {m: int(store.get(f"{prefix}/here/{m}").decode()) for m in here}
            proposal = json.dumps({"failed": sorted(dead), "iterations": iterations, "by": rank})
            store.compare_set(decision_key, "", proposal)
            break
        time.sleep(poll_s)
    decision = json.loads(store.get(decision_key).decode())
    its = set(decision["iterations"].values())
    if len(its) > 1:
        raise AgreementError(f"generation {generation}: survivors are in different iterations {decision['iterations']} "
                             f"(a rank stepped its optimizer before the failure). Fix: restart from the last "
                             f"checkpoint on the survivors")
    return Agreement(generation=generation, failed=tuple(decision["failed"]), iteration=iteration,
                     decided_by=int(decision["by"]), waited_s=time.time() - start)
