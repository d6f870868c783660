"""``omnirelay up``'s log forwarding: every child's line comes out whole and prefixed, however long."""

from __future__ import annotations

import io

from libs.stack.processes import copy_lines


def test_a_last_line_without_newline_is_ended_so_the_next_line_is_its_own() -> None:
    out = io.StringIO()
    copy_lines(
        "talker-0", io.BytesIO(b"first\nSee https://nanobind.readthedocs.io/en/latest/refleaks.html"), 10, out
    )
    copy_lines("nats", io.BytesIO(b"Server Exiting.."), 10, out)
    assert out.getvalue().splitlines() == [
        "talker-0   | first",
        "talker-0   | See https://nanobind.readthedocs.io/en/latest/refleaks.html",
        "nats       | Server Exiting..",
    ]


def test_a_line_over_64_kib_comes_out_whole_and_the_copying_goes_on() -> None:
    """A log line quoting a 64 KiB field (the bus fuzzer's, tests/e2e/test_fuzz_bus.py) once stopped
    the copying, and the service then blocked on its full pipe."""
    out = io.StringIO()
    long = "x" * (200 * 1024)
    copy_lines("svc", io.BytesIO(f"before\n{long}\nafter\n".encode()), 5, out)
    assert out.getvalue().splitlines() == ["svc   | before", f"svc   | {long}", "svc   | after"]
