"""The resilience store listens only where it is told (loopback for one machine), every value read
from it is checked, and heartbeats are judged on the reader's monotonic clock (#21 items 4 and 9)."""

from __future__ import annotations

import datetime
import errno
import ipaddress
import socket

import psutil
import pytest
import torch.distributed as dist

from megatron_het.resilience.agreement import AgreementError, HeartbeatAges, agree_on_failures, last_heartbeat
from megatron_het.resilience.launch import LOOPBACK, serve_store


def _other_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces other than loopback."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                out.append(a.address)
    return out


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_store_listens_on_loopback_only():
    store, address = serve_store(LOOPBACK)
    assert address.host == LOOPBACK
    assert _listening(address.port) == [LOOPBACK]  # torch alone would listen on 0.0.0.0 / ::
    client = address.connect(timeout_s=5)
    client.set("k", "v")
    assert store.get("k") == b"v"
    for other in _other_addresses():  # a host with only loopback still checked above
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            code = s.connect_ex((other, address.port))
        assert code in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH), (other, code)


def test_plain_torch_store_would_listen_everywhere():
    """What serve_store works around (so the test above means something)."""
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    assert set(_listening(store.port)) & {"0.0.0.0", "::"}


def _master():
    store, address = serve_store(LOOPBACK, timeout_s=5)
    return store


@pytest.mark.parametrize("key,value,match", [
    ("hb/1", b"\xff\xfe beat", r"'hb/1' holds .* expected a heartbeat counter"),
    ("hb/1", b"nan", r"'hb/1' holds b'nan', expected a finite heartbeat counter"),
    ("agree/1/here/1", b"seven", r"'agree/1/here/1' holds b'seven', expected an integer"),
    ("agree/1/decision", b"{not json", r"'agree/1/decision' holds .* expected the decision JSON"),
    ("agree/1/decision", b'{"failed": [9], "iterations": {"0": 1}, "by": 0}', r"over members \[0, 1\]"),
    ("agree/1/decision", b'{"failed": [], "iterations": {"0": "x"}, "by": 0}', r"expected \{\"failed\""),
])
def test_malformed_store_values_are_one_clear_error(key, value, match):
    store = _master()
    store.set("hb/0", "0")
    store.set(key, value)
    if key.startswith("hb/"):
        with pytest.raises(AgreementError, match=match):
            last_heartbeat(store, 1)
        return
    with pytest.raises(AgreementError, match=match + r".*Fix: only megatron-het ranks"):
        agree_on_failures(store, generation=1, rank=0, members=(0, 1), iteration=1, heartbeat_timeout_s=0.5,
                          timeout_s=2.0, poll_s=0.01)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_age_is_time_since_the_reader_saw_a_change():
    store, clock = _master(), _Clock()
    ages = HeartbeatAges(store, clock=clock)
    store.set("hb/0", "1e12")  # a writer whose wall clock is far ahead: irrelevant, only changes count
    assert ages.age(0) == 0.0
    clock.now += 3.0
    assert ages.age(0) == 3.0  # unchanged for 3 s of this reader's clock: 3 s old
    store.set("hb/0", "1000000000001")  # it beat
    assert ages.age(0) == 0.0
    clock.now += 0.5
    assert ages.age(0) == 0.5
    assert ages.age(7) == 0.0  # never written: watched from now on
    clock.now += 2.0
    assert ages.age(7) == 2.0


def test_store_gone_is_one_agreement_error():
    store, address = serve_store(LOOPBACK, timeout_s=5)
    client = address.connect(timeout_s=2)
    client.set("hb/0", "0")
    del store  # the launcher hosting the store stops
    with pytest.raises(AgreementError, match=r"resilience store: .* failed .*Fix: the launcher hosting the store"):
        agree_on_failures(client, generation=1, rank=0, members=(0, 1), iteration=1, heartbeat_timeout_s=0.5,
                          timeout_s=2.0, poll_s=0.01)
