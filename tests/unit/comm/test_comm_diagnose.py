"""The failure diagnosis stops at the first store error (#21 item 9): a gone store would otherwise
cost one store timeout per rank; malformed counters are reported, not a crash."""

from __future__ import annotations

from megatron_het.comm.diagnose import Behind, failure_message, ranks_behind


class _Store:
    """Answers for the first ``alive`` keys, then fails like a store whose host exited."""

    def __init__(self, values: dict[str, bytes], alive: int) -> None:
        self.values, self.alive, self.calls = values, alive, 0

    def _touch(self) -> None:
        self.calls += 1
        if self.calls > self.alive:
            raise RuntimeError("Connection reset by peer\n(detail)")

    def check(self, keys):
        self._touch()
        return all(k in self.values for k in keys)

    def get(self, key):
        self._touch()
        return self.values[key]


def test_stops_at_the_first_store_error():
    store = _Store({"seq/0": b"4", "seq/1": b"3"}, alive=4)  # check+get for ranks 0 and 1, then gone
    behind = ranks_behind(store, 64, seq=4)
    assert store.calls == 5  # one failed call, not one (timed-out) call per remaining rank
    assert behind == Behind(ranks=[(1, 3)], unreachable="Connection reset by peer", unchecked_from=2)
    msg = failure_message(group="g", rank=0, op="all_reduce", seq=4, waited_s=1.0, timeout_s=1, behind=behind,
                          global_ranks=tuple(range(64)), cause="Timed out")
    assert ("ranks that never entered it: rank 1 (group rank 1, last entered #3); the store is unreachable "
            "(Connection reset by peer), group ranks 2..63 not checked") in msg


def test_malformed_counter_is_reported():
    behind = ranks_behind(_Store({"seq/0": b"4", "seq/1": b"\xffjunk"}, alive=100), 2, seq=4)
    assert behind == Behind(ranks=[(1, -1)])
    msg = failure_message(group="g", rank=0, op="barrier", seq=4, waited_s=1.0, timeout_s=1, behind=behind,
                          global_ranks=(0, 7), cause="x")
    assert "rank 7 (group rank 1, counter unreadable)" in msg
