"""``free_port`` picks below the kernel's ephemeral range, where no outgoing connection takes a
port between the pick and the bind of the process it is for (a CI run of 2026-11-29 lost a
worker's metrics port that way)."""

from __future__ import annotations

import socket

import pytest

from libs.stack import local_nats
from libs.stack.local_nats import LOWEST_FREE_PORT, free_port


def test_ports_are_below_the_ephemeral_range_free_and_never_repeated() -> None:
    low = int(local_nats.EPHEMERAL_RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(300)]
    assert all(LOWEST_FREE_PORT <= p < low for p in ports), [
        p for p in ports if not LOWEST_FREE_PORT <= p < low
    ]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: a listener can take it


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two ports below the range and one of them taken, the other comes back."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(local_nats, "LOWEST_FREE_PORT", busy)
        monkeypatch.setattr(local_nats, "_ephemeral_low", lambda: busy + 1_002)
        monkeypatch.setattr(local_nats, "_handed_out", set(range(busy + 2, busy + 1_002)))
        assert free_port() == busy + 1


def test_without_room_below_the_range_the_os_picks(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    narrow = tmp_path / "range"
    narrow.write_text(f"{LOWEST_FREE_PORT}\t60999\n")
    monkeypatch.setattr(local_nats, "EPHEMERAL_RANGE", narrow)
    assert free_port() >= LOWEST_FREE_PORT
