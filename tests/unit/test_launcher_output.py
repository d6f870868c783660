"""``omnirelay up``'s log forwarding: every child's line comes out whole and prefixed."""

from __future__ import annotations

import asyncio

from cli.launcher import _pump


async def test_a_last_line_without_newline_is_ended_so_the_next_line_is_its_own(capsys) -> None:
    stream = asyncio.StreamReader()
    stream.feed_data(b"first\nSee https://nanobind.readthedocs.io/en/latest/refleaks.html")
    stream.feed_eof()
    await _pump("talker-0", stream, 10)
    print("nats       | Server Exiting..")
    assert capsys.readouterr().out.splitlines() == [
        "talker-0   | first",
        "talker-0   | See https://nanobind.readthedocs.io/en/latest/refleaks.html",
        "nats       | Server Exiting..",
    ]
