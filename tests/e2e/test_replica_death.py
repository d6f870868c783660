"""A thinker replica killed (SIGKILL) or stopped (SIGSTOP) while it streams: the orchestrator
notices, the streams it held move to the other replica and go on where each client's stream stands
— every stream completes with exactly ``max_tokens`` tokens, none missing or repeated — and the
eviction and the moves are counted."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time

import httpx
import nats
import pytest
from nats.js.errors import KeyNotFoundError

from benchmarks.chat_streams import Seen, send
from libs.common.bus import requests_kv
from libs.common.pipeline import load_pipeline
from libs.stack.bus_state import request_record, snapshot
from libs.stack.processes import until
from tests.bus import await_replacement
from tests.metrics_scrape import delta, scrape
from tests.procs import kill_confirmed, stop_confirmed, worker_pid

pytestmark = pytest.mark.e2e

THINKER = load_pipeline().thinker_stage
"""The default pipeline's thinker: the stage whose replica these tests kill or stop."""
STREAMS, MAX_TOKENS = 6, 1900
PROMPT = "Tell me everything."
MIDWAY_TOKENS = 100
"""A stream is cut mid-way when the client has at least this many of its tokens..."""
TOKENS_LEFT = 1000
"""... and at most ``MAX_TOKENS`` minus this many: a replica that has the cores to itself makes
~800 tokens/s, so fewer left could finish between the pick and the kill (it did once, and the fault
hit no stream)."""
MOVE_SENT_WITHIN_S = 6.0
"""How long after the kill the moved streams' input must have been sent to the surviving replica
(the record's ``sent_ns`` of the new attempt), seconds. The documented target is 2 s (the verdict
≤ 0.5 s, then the move) and holds with a free core (fault suite 0.3–1.2 s; 0.35 s here alone);
in the full session one run took 4.0 s (the gateway, starved, answered the move's question on
its second ask: ``REROUTE_TRIES``). The bound separates a move from waiting for a deadline."""
MOVED_WITHIN_S = 8.0
"""The longest pause a moved stream may show its client beyond the fault's own, seconds. On top
of the move, the new replica prefills the prompt and the resumed tokens while, in the full
session, the replacement engine starts on the same two cores and the test's one client reads six
streams: 0.3–1.2 s in the fault suite, up to 5.7 s seen here. The bound says the streams moved
rather than waited for a deadline; the pause is printed."""
FLOWING_S = 0.3
"""A stream counts as mid-way only while its tokens flow (one came this recently, seconds): while
the broker is silent (seen for 4–9 s at the start of these streams in full runs) the client gets
nothing and the records go stale, so a pick then found every stream finished on the server by the
time of the kill (twice in a row: "no stream was moved by the fault")."""
CLIENT_LAG_S = 3.0
"""How far the test's own client may run behind the server when a stall strikes (it reads six
streams on a two-core box), seconds: its pause is that much shorter than the stall."""


@pytest.fixture(scope="module")
def reference(stack, pipeline) -> list[int]:
    """The tokens of the streams' request without a fault (greedy; asked once for the module)."""
    return asyncio.run(_greedy(stack, pipeline))


async def _greedy(stack, pipeline) -> list[int]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": pipeline.served_model_name,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


ROUNDS = 3
"""Rounds of streams ``_streams_and_victim`` may start before it gives up finding a moment to strike:
on two shared cores the client can fall so far behind the server that a round's streams leave
the thinker before two of them are mid-way at the client (it happened once in a full CI run)."""


async def _midway_victim(kv, seen: list[Seen], tasks: list[asyncio.Task], timeline: list[str]) -> int | None:
    """Watch one round of streams until at least two run in the thinker mid-way (between
    ``MIDWAY_TOKENS`` and ``MAX_TOKENS - TOKENS_LEFT`` tokens at the client) and return the replica
    of the mid-way stream with the most tokens still to come; ``None`` once every stream has ended
    without such a moment. Appends what it saw (client token counts, thinker replicas) to
    ``timeline``."""
    while not all(t.done() for t in tasks):
        recs = []
        for s in seen:
            with contextlib.suppress(KeyNotFoundError):  # the record follows the stream's start
                recs += [json.loads((await kv.get(s.id)).value)] if s.id else []
        running = {r["request_id"]: r["route"][THINKER] for r in recs if not r["stages"][THINKER]["done_ns"]}
        now = time.monotonic()
        midway = [
            s
            for s in seen
            if s.id in running
            and MIDWAY_TOKENS <= len(s.token_ids) <= MAX_TOKENS - TOKENS_LEFT
            and now - s.at[-1] <= FLOWING_S
        ]
        timeline.append(
            f"{time.monotonic():.2f} s: client tokens {[len(s.token_ids) for s in seen]}, thinker on {sorted(running.values())}"
        )
        if len(midway) >= 2:
            return running[min(midway, key=lambda s: len(s.token_ids)).id]
        await asyncio.sleep(0.05)
    return None


async def _streams_and_victim(stack, pipeline):
    """Start ``STREAMS`` streams and pick a victim replica (``_midway_victim``), in up to ``ROUNDS``
    rounds. Returns (client, what each client of the round saw, their tasks, the victim, how many
    streams were started in all)."""
    client = stack.client(120)
    timeline: list[str] = []
    nc = await nats.connect(stack.nats_url)
    try:
        kv = await requests_kv(nc.jetstream())
        for n in range(1, ROUNDS + 1):
            seen = [Seen() for _ in range(STREAMS)]
            tasks = [
                asyncio.create_task(send(client, pipeline.served_model_name, s, PROMPT, MAX_TOKENS))
                for s in seen
            ]
            victim = await asyncio.wait_for(_midway_victim(kv, seen, tasks, timeline), 120)
            assert all(s.error is None for s in seen), [str(s.error) for s in seen if s.error]
            if victim is not None:
                return client, seen, tasks, victim, n * STREAMS
            print(
                f"no moment to strike in this round of streams; what the test saw:\n{chr(10).join(timeline[::5])}"
            )
            timeline.clear()
    finally:
        await nc.close()
    raise AssertionError(f"in {ROUNDS} rounds, never two streams mid-way in the thinker at once")


async def _moved(stack, seen: list[Seen], victim: int, reason: str, reference: list[int]) -> dict[str, dict]:
    """Check that every stream completed in full with exactly ``reference`` (the fault-free greedy
    tokens), and that those the fault hit moved once, off ``victim``, for ``reason``. Returns the
    moved streams' records by request id."""
    moved: dict[str, dict] = {}
    for s in seen:
        assert s.error is None, (s.id, s.error)
        assert s.usage_tokens == MAX_TOKENS, (s.id, s.usage_tokens)
        assert len(s.token_ids) == MAX_TOKENS, (s.id, len(s.token_ids))
        assert s.finish_reason == "length", (s.id, s.finish_reason)
        # None missing, none repeated, none out of order: the greedy tokens of the same request
        # without a fault, position by position.
        first_wrong = next(
            (i for i, (a, b) in enumerate(zip(s.token_ids, reference, strict=True)) if a != b), None
        )
        assert first_wrong is None, (
            s.id,
            first_wrong,
            s.token_ids[max(0, first_wrong - 2) : first_wrong + 3],
        )
        for _ in range(50):  # the record hears of the end a little after the client
            rec = await request_record(stack.nats_url, s.id)
            if rec["status"] != "running":
                break
            await asyncio.sleep(0.1)
        assert rec["status"] == "completed", rec
        attempts = rec["stages"][THINKER]["attempts"]
        if len(attempts) > 1:
            first, second = attempts
            assert first["replica"] == victim and second["replica"] != victim, attempts
            assert second["attempt"] == 2 and second["reason"] == reason, attempts
            assert second["phase"] in ("queued", "in_progress"), attempts
            moved[s.id] = rec
    assert moved, "no stream was moved by the fault"
    return moved


def _longest_pause(seen: list[Seen], moved: dict[str, dict]) -> float:
    """The longest pause between two tokens of a moved stream, as the client read them, seconds
    (the fault's pause, shortened by what the client had still to read when it struck)."""
    return max((b - a for s in seen if s.id in moved for a, b in itertools.pairwise(s.at)), default=0.0)


async def _registered(stack, pipeline) -> list[dict]:
    """The registry's services once it holds one orchestrator and one gateway (a record missing
    for a moment comes back with the next heartbeat: in a full run the orchestrator's was missing
    while the thinker an earlier test killed started its engine anew)."""

    async def both() -> list[dict] | None:
        services = (await snapshot(stack.nats_url, pipeline))["services"]
        kinds = [s["service"] for s in services]
        return services if kinds.count("orchestrator") == kinds.count("gateway") == 1 else None

    t0 = time.monotonic()
    services = await until(both, "one orchestrator and one gateway registered", timeout_s=30)
    if time.monotonic() - t0 > 0.5:
        print(f"waited {time.monotonic() - t0:.1f} s for the registry's orchestrator and gateway")
    return services


async def test_streams_on_a_killed_replica_move_and_complete(stack, pipeline, reference) -> None:
    """``kill -9`` of a thinker worker while it streams."""
    reason = "exit"
    services = await _registered(stack, pipeline)
    incarnations = {s["key"]: s["started_ns"] for s in services}
    (orchestrator,) = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    (gateway,) = [s["metrics_url"] for s in services if s["service"] == "gateway"]
    before_o, before_g = scrape(orchestrator), scrape(gateway)

    client, seen, tasks, victim, started = await _streams_and_victim(stack, pipeline)
    try:
        killed_ns = time.time_ns()
        await kill_confirmed(worker_pid(stack.proc.pid, THINKER, victim), "the thinker worker")

        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await client.close()
        moved = await _moved(stack, seen, victim, reason, reference)
        pause = _longest_pause(seen, moved)
        sent_s = max(
            (r["stages"][THINKER]["attempts"][-1]["sent_ns"] - killed_ns) / 1e9 for r in moved.values()
        )
        print(
            f"{len(moved)} stream(s) moved off replica {victim}; sent to the survivor {sent_s:.2f} s after the "
            f"kill; their longest pause at the client {pause:.2f} s"
        )
        assert sent_s <= MOVE_SENT_WITHIN_S, sent_s
        assert pause <= MOVED_WITHIN_S, pause
        after_o, after_g = scrape(orchestrator), scrape(gateway)
        evictions = delta(
            before_o,
            after_o,
            "vllm:omni_replica_evictions_total",
            stage=str(THINKER),
            replica=str(victim),
            reason=reason,
        )
        assert evictions == 1
        migrated = delta(
            before_o,
            after_o,
            "vllm:omni_requests_migrated_total",
            stage=str(THINKER),
            from_replica=str(victim),
            reason=reason,
        )
        assert migrated == len(moved)
        assert (
            delta(before_g, after_g, "vllm:omni_requests_success_total", finished_reason="length") == started
        )
        assert delta(before_g, after_g, "vllm:omni_requests_failed_total") == 0
    finally:
        # Leave the stack whole for the tests after this one.
        key = f"worker.{pipeline.name}.{THINKER}.{victim}"
        await await_replacement(stack.nats_url, pipeline, key, incarnations[key])
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as http:
            assert (await http.get("/health")).json()["status"] == "ok"


async def test_streams_on_a_stopped_replica_move_after_the_stall_timeout(stack, pipeline, reference) -> None:
    """SIGSTOP: the process lives and holds its connection, but answers nothing. Its streams move
    ``stall_timeout_s`` later and complete in full; after SIGCONT it stops the work it no longer
    owns, and nothing it still sends reaches a client."""
    stall_s = pipeline.stages[THINKER].stall_timeout_s
    services = await _registered(stack, pipeline)
    (orchestrator,) = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    before = scrape(orchestrator)

    client, seen, tasks, victim, _ = await _streams_and_victim(stack, pipeline)
    pid = worker_pid(stack.proc.pid, THINKER, victim)
    try:
        await stop_confirmed(pid, "the thinker worker")
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        os.kill(pid, signal.SIGCONT)
        resumed_ns = time.time_ns()
    await client.close()
    moved = await _moved(stack, seen, victim, "stall", reference)
    pause = _longest_pause(seen, moved)
    print(f"{len(moved)} stream(s) moved off stopped replica {victim}; their longest pause {pause:.2f} s")
    assert stall_s - CLIENT_LAG_S < pause <= stall_s + MOVED_WITHIN_S, pause
    after = scrape(orchestrator)
    assert (
        delta(
            before,
            after,
            "vllm:omni_replica_evictions_total",
            stage=str(THINKER),
            replica=str(victim),
            reason="stall",
        )
        == 1
    )
    assert delta(
        before,
        after,
        "vllm:omni_requests_migrated_total",
        stage=str(THINKER),
        from_replica=str(victim),
        reason="stall",
    ) == len(moved)
    # Resumed, the worker reads the notices that waited for it and stops the requests that moved
    # (or finishes one whose tokens its engine had made meanwhile: the gateway drops what it
    # sends): either way it is idle again, soon.
    key = f"worker.{pipeline.name}.{THINKER}.{victim}"
    for _ in range(60):
        rec = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}.get(key)
        if rec and rec["heartbeat_ns"] > resumed_ns and rec["load"] == 0:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"the resumed worker still holds work: {rec}")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as http:
        for _ in range(60):
            if (await http.get("/health")).json()["status"] == "ok":
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the resumed replica did not come back to the registry")
