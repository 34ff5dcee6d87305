"""Failure detection and agreement through a rendezvous store that outlives any training rank.

Detection has two sources: a collective or point-to-point call that raises (gloo closes every
pair of a context when a peer's socket drops, so all survivors see an error within about a second
of a SIGKILL; a hung peer is caught by the process-group timeout), and heartbeats each rank writes
to the store (``hb/{rank}`` = a beat counter, every ``interval_s``). A heartbeat's age is judged on
the reader's monotonic clock: the time since this reader last saw the counter change (clocks of
different hosts are never compared). Agreement: each survivor that caught
an error announces itself for the generation, then waits until every member has either announced
itself or let its heartbeat go stale; the first to finish writes the decision with an atomic
compare-and-set, and everybody adopts that decision. A member that never announces itself is
declared failed after ``timeout_s`` even if it still beats (it is stuck), so the decision comes
within ``max(heartbeat_timeout_s, time for every survivor to hit an error) <= timeout_s``.

Every value read from the store is checked (the store is shared by all ranks and, on a cluster,
reachable by the network): a malformed one is an AgreementError naming the key, not a crash.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
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
    """The survivors cannot agree (they are in different iterations, the store is gone, or it holds
    a value no rank wrote)."""


_STORE_FIX = ("only megatron-het ranks may write to the resilience store: check that nothing else connects to it "
              "(it listens on the interface in docs/resilience.md), then restart from the last checkpoint")


def _get(store: dist.Store, key: str) -> bytes:
    """``store.get`` with a store failure turned into one AgreementError naming the key."""
    try:
        return store.get(key)
    except Exception as err:  # DistStoreError, timeouts, a closed connection: the store is gone
        raise AgreementError(f"resilience store: reading {key!r} failed ({err.__class__.__name__}: {err}). "
                             "Fix: the launcher hosting the store has stopped; restart the job") from None


def _check(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception as err:
        raise AgreementError(f"resilience store: checking {key!r} failed ({err.__class__.__name__}: {err}). "
                             "Fix: the launcher hosting the store has stopped; restart the job") from None


def _malformed(key: str, raw: bytes, expected: str) -> AgreementError:
    return AgreementError(f"resilience store: {key!r} holds {raw[:80]!r}, expected {expected}. Fix: {_STORE_FIX}")


def _read_int(store: dist.Store, key: str) -> int:
    raw = _get(store, key)
    try:
        text = raw.decode("ascii").strip()
        if not text.lstrip("-").isdigit() or len(text) > 20:
            raise ValueError(text)
        return int(text)
    except (UnicodeDecodeError, ValueError):
        raise _malformed(key, raw, "an integer") from None


class Heartbeat:
    """Background thread writing ``hb/{rank}`` = a beat counter every ``interval_s`` (own store client)."""

    def __init__(self, address: StoreAddress, rank: int, *, interval_s: float = 0.5, prefix: str = "") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0 (got {interval_s}). Fix: use e.g. 0.5 seconds")
        self.address, self.rank, self.interval_s = address, rank, interval_s
        self._stop = threading.Event()
        self._beats = 0  # written values: readers only look for a change
        self._store = dist.PrefixStore(prefix, address.connect()) if prefix else address.connect()
        self._store.set(f"hb/{rank}", str(self._beats))
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beats += 1
            try:
                self._store.set(f"hb/{self.rank}", str(self._beats))
            except Exception:  # store gone: the launcher is ending the job
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)


def last_heartbeat(store: dist.Store, rank: int) -> float | None:
    """``rank``'s last heartbeat value (a beat counter; None if it never wrote one), validated."""
    key = f"hb/{rank}"
    if not _check(store, key):
        return None
    raw = _get(store, key)
    try:
        value = float(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise _malformed(key, raw, "a heartbeat counter") from None
    if not math.isfinite(value):
        raise _malformed(key, raw, "a finite heartbeat counter")
    return value


class HeartbeatAges:
    """How long ago this reader saw each member's heartbeat change, on its own monotonic clock.

    A value first seen counts as a change (age 0): a member gets a whole ``heartbeat_timeout_s``
    from the moment this reader starts watching, whatever the writers' clocks say.
    """

    def __init__(self, store: dist.Store, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store  # where hb/{rank} live
        self.clock = clock  # the reader's monotonic clock (injectable for tests)
        self.seen: dict[int, tuple[float | None, float]] = {}  # rank -> (last value, when it last changed)

    def age(self, rank: int) -> float:
        now, value = self.clock(), last_heartbeat(self.store, rank)
        previous = self.seen.get(rank)
        if previous is None or previous[0] != value:
            self.seen[rank] = (value, now)
            return 0.0
        return now - previous[1]


def _decision(raw: bytes, key: str, members: Sequence[int]) -> dict:
    """The decision JSON, checked: failed members, each survivor's iteration, the writer."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _malformed(key, raw, "the decision JSON") from None
    allowed = set(members)

    def ints(values) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in values)

    ok = (isinstance(data, dict) and set(data) == {"failed", "iterations", "by"}
          and isinstance(data["failed"], list) and ints(data["failed"]) and set(data["failed"]) <= allowed
          and isinstance(data["iterations"], dict) and ints(data["iterations"].values())
          and all(k.isdigit() and int(k) in allowed for k in data["iterations"])
          and isinstance(data["by"], int) and data["by"] in allowed)
    if not ok:
        raise _malformed(key, raw, f'{{"failed": [...], "iterations": {{rank: iteration}}, "by": rank}} over '
                                   f"members {sorted(allowed)}")
    return data


def agree_on_failures(store: dist.Store, *, generation: int, rank: int, members: Sequence[int], iteration: int,
                      heartbeat_timeout_s: float = 5.0, timeout_s: float = 60.0, poll_s: float = 0.05) -> Agreement:
    """Announce this rank as alive in ``generation`` and return the agreed set of failed members.

    Raises AgreementError when the survivors are in different iterations, when the store fails, or
    when it holds a malformed value.
    """
    if heartbeat_timeout_s <= 0 or timeout_s < heartbeat_timeout_s:
        raise ValueError(f"heartbeat_timeout_s/timeout_s: need 0 < heartbeat_timeout_s <= timeout_s (got "
                         f"{heartbeat_timeout_s} and {timeout_s}). Fix: e.g. 5 and 60 seconds")
    start = time.monotonic()
    ages = HeartbeatAges(store)
    prefix = f"agree/{generation}"
    try:
        store.set(f"{prefix}/here/{rank}", str(iteration))
    except Exception as err:
        raise AgreementError(f"resilience store: announcing rank {rank} failed ({err.__class__.__name__}: {err}). "
                             "Fix: the launcher hosting the store has stopped; restart the job") from None
    decision_key = f"{prefix}/decision"
    while True:
        if _check(store, decision_key):
            break
        waited = time.monotonic() - start
        here, dead, unknown = [], [], []
        for m in members:
            if _check(store, f"{prefix}/here/{m}"):
                here.append(m)
            elif ages.age(m) > heartbeat_timeout_s or waited > timeout_s:
                dead.append(m)
            else:
                unknown.append(m)
        if not unknown:
            iterations = {m: _read_int(store, f"{prefix}/here/{m}") for m in here}
            proposal = json.dumps({"failed": sorted(dead), "iterations": iterations, "by": rank})
            try:
                store.compare_set(decision_key, "", proposal)
            except Exception as err:
                raise AgreementError(f"resilience store: writing {decision_key!r} failed "
                                     f"({err.__class__.__name__}: {err}). Fix: the launcher hosting the store has "
                                     "stopped; restart the job") from None
            break
        time.sleep(poll_s)
    decision = _decision(_get(store, decision_key), decision_key, members)
    its = set(decision["iterations"].values())
    if len(its) > 1:
        raise AgreementError(f"generation {generation}: survivors are in different iterations {decision['iterations']} "
                             f"(a rank stepped its optimizer before the failure). Fix: restart from the last "
                             f"checkpoint on the survivors")
    return Agreement(generation=generation, failed=tuple(decision["failed"]), iteration=iteration,
                     decided_by=int(decision["by"]), waited_s=time.monotonic() - start)
