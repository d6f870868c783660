"""What a client and the wire saw of streamed chat completions, for the fault tests that judge
whether a request that moved gave its client every token exactly once.

The ground truth is taken outside the code under test: the client's tokens come from the official
``openai`` client (``return_token_ids``), the tokens each stage-0 attempt sent from a subscription
of the test's own on the pipeline's ``out`` subjects (core NATS hands every subscriber its own
copy, so listening changes nothing for the gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from openai import AsyncOpenAI

from benchmarks.chat_streams import Seen, send
from libs.common.bus import bucket_keys as listed_keys
from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.records import RequestRecord
from libs.common.subjects import REQUESTS_BUCKET, Subjects
from libs.stack.processes import until
from tests.bus import client_events, in_flight

PROMPT = "Tell me everything about the sea."


async def until_tokens(seen: Seen, task: asyncio.Task[None], count: int, timeout_s: float = 120.0) -> None:
    """Wait until the client of ``seen`` has its request id and ``count`` tokens (fails if its
    stream ended first)."""

    def reached() -> bool:
        assert not task.done(), f"the stream ended with {len(seen.token_ids)} tokens: {seen.error}"
        return len(seen.token_ids) >= count and bool(seen.id)

    await until(reached, f"{count} tokens and the request id", timeout_s, every_s=0.02)


@dataclass
class Streams:
    """Streams started together: each client's view and task, and their request ids as the
    records tell them. A client reading several streams on a busy box, through a gateway reading
    thousands of events a second, learns where its stream is seconds after the server (and the
    broker has been seen silent for seconds just then): a fault test picks its moment by what the
    workers say over HTTP (:func:`until_received`), not by the clients or the bus."""

    seen: list[Seen]
    tasks: list[asyncio.Task[None]]
    nc: Client
    """The connection the keys of ``omni_requests`` are listed on."""
    before: set[str]
    """The keys of ``omni_requests`` before the streams were sent."""
    sent_ns: int
    """Wall clock (ns) before the streams were sent: a record that arrived earlier is not one of
    theirs (a second guard beside ``before``)."""
    ids: set[str] = field(default_factory=set)

    @classmethod
    async def start(cls, client: AsyncOpenAI, model: str, count: int, max_tokens: int, nc: Client) -> Streams:
        """``count`` streams of ``max_tokens`` tokens, started (returns at once)."""
        before, sent_ns = await bucket_keys(nc, REQUESTS_BUCKET), time.time_ns()
        seen = [Seen() for _ in range(count)]
        tasks = [asyncio.create_task(send(client, model, s, PROMPT, max_tokens)) for s in seen]
        return cls(seen, tasks, nc, before, sent_ns)

    async def admitted(self, kv: KeyValue, pipeline: str, timeout_s: float = 60.0) -> set[str]:
        """The request ids of the streams, once each has its record."""

        async def all_admitted() -> bool:
            for key in await bucket_keys(self.nc, REQUESTS_BUCKET) - self.before - self.ids:
                with contextlib.suppress(KeyNotFoundError):
                    rec = await record(kv, key)
                    if rec.pipeline == pipeline and rec.arrival_ns >= self.sent_ns:
                        self.ids.add(key)
                    else:
                        self.before.add(key)
            return len(self.ids) >= len(self.seen)

        await until(
            all_admitted, f"a record for each of the {len(self.seen)} streams", timeout_s, every_s=0.02
        )
        return self.ids

    async def finish(self, timeout_s: float = 180.0) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)
        if self.ids:
            assert {s.id for s in self.seen} == self.ids, "the clients' ids are not the records'"
        self.ids = {s.id for s in self.seen}

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


async def bound_by_replica(kv: KeyValue, streams: Streams, pipeline: str) -> dict[int, set[str]]:
    """Once the streams are admitted: the thinker replica each was bound to → those streams.
    Read right after admission (the broker is quick then; under the streams' full flow its
    answers have lagged the engines by seconds)."""
    by: dict[int, set[str]] = {}
    for rid in await streams.admitted(kv, pipeline):
        by.setdefault((await record(kv, rid)).route[0], set()).add(rid)
    return by


async def most_bound(kv: KeyValue, streams: Streams, pipeline: str) -> tuple[int, set[str]]:
    """The thinker replica most of the streams were bound to, and those (:func:`bound_by_replica`)."""
    by = await bound_by_replica(kv, streams, pipeline)
    victim = max(by, key=lambda r: len(by[r]))
    return victim, by[victim]


async def holding(
    nc: Client, pipeline: str, replicas: list[int], n: int = 2, timeout_s: float = 60.0
) -> int | None:
    """A thinker replica of ``replicas`` that holds ``n`` requests at least, as the replica itself
    says in its liveness answer, or None when none did within ``timeout_s``. Each replica is asked
    on its own, again 50 ms after each answer, and the first that holds ``n`` is taken the moment
    it says so: asked together, one answer waits for the slowest (in CI of 2026-11-28 a replica's
    count sat 2 s behind its starved peer's timeout, and its streams ended before the fault
    struck). With one request at a time, one of the ``n`` still waits, so a fault that strikes
    now finds a stream there. What the clients or the buckets show may lag the worker by seconds
    on a loaded box (the broker was silent for 5 s once)."""

    async def until_holding(replica: int) -> int:
        while (await in_flight(nc, Subjects(pipeline), 0, replica, timeout_s=2.0) or 0) < n:
            await asyncio.sleep(0.05)  # no answer in time, or none subscribed (exited), or fewer
        return replica

    watches = [asyncio.create_task(until_holding(r)) for r in replicas]
    try:
        done, _ = await asyncio.wait(watches, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
    return min(done, key=watches.index).result() if done else None


async def struck(kv: KeyValue, on_victim: set[str], timeout_s: float = 60.0) -> set[str]:
    """Of the streams bound to a replica a fault struck: wait until each has moved or ended, and
    return those that moved (one the replica finished before the fault was not struck). At least
    one must have been."""
    hit, ended = set(), {}
    for rid in on_victim:
        rec = await until_record(
            kv, rid, lambda r: moved(r) or r.status.terminal, "moved or ended", timeout_s
        )
        if moved(rec):
            hit.add(rid)
        else:
            ended[rid] = (rec.status.value, rec.error)
    assert hit, f"the fault struck no stream: each had ended on the victim {ended}"
    return hit


async def bucket_keys(nc: Client, bucket: str, timeout_s: float = 30.0) -> set[str]:
    """The keys of ``bucket`` (:func:`libs.common.bus.bucket_keys`), asked again while the broker
    does not answer in time (it goes quiet for seconds on a loaded box, docs/reliability.md)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await listed_keys(nc, bucket)
        except NatsTimeoutError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@dataclass
class Wire:
    """Every client event of a pipeline as it passed the broker, with when it did."""

    events: dict[str, list[tuple[float, ClientEvent]]] = field(default_factory=dict)
    """Request id → (``time.monotonic()`` of arrival, event), in arrival order."""

    async def listen(self, nc: Client, pipeline: str) -> None:
        async def on_event(msg: Msg) -> None:
            now = time.monotonic()
            for event in client_events(msg):
                self.events.setdefault(event.request_id, []).append((now, event))

        await nc.subscribe(f"omni.{pipeline}.out.>", cb=on_event)

    def text_events(self, request_id: str, attempt: int, stage: int = 0) -> list[ClientEvent]:
        """The ``TEXT`` events of one stage attempt, in ``seq`` order, each once."""
        by_seq = {
            e.seq: e
            for _, e in self.events.get(request_id, [])
            if e.type == ClientEventType.TEXT and e.stage == stage and e.attempt == attempt
        }
        return [by_seq[s] for s in sorted(by_seq)]


def tokens_of(events: list[ClientEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def client_tokens(wire: Wire, rec: RequestRecord) -> list[int]:
    """The tokens the client of ``rec`` must have, from what each stage-0 attempt sent: of every
    attempt the next one took over from, its tokens up to where the client stood at the move (the
    next attempt's ``resumed_tokens``, what the gateway answered); of the last attempt, every token
    it sent. A token lost or repeated at the client makes its list differ."""
    attempts = rec.stages[0].attempts
    out: list[int] = []
    for a, after in zip(attempts, [*attempts[1:], None], strict=True):
        sent = tokens_of(wire.text_events(rec.request_id, a.attempt))
        if after is None:
            out += sent
            continue
        take = after.resumed_tokens - a.resumed_tokens
        assert 0 <= take <= len(sent), (rec.request_id, a.attempt, take, len(sent))
        out += sent[:take]
    return out


def attempts_of(rec: RequestRecord) -> list[tuple[int, int, str | None]]:
    """(attempt, replica, reason) of each stage-0 attempt of the record."""
    return [(a.attempt, a.replica, a.reason) for a in rec.stages[0].attempts]


async def record(kv: KeyValue, request_id: str) -> RequestRecord:
    """The request's record in ``omni_requests`` (``kv``)."""
    return RequestRecord.model_validate_json((await kv.get(request_id)).value)


async def until_record(
    kv: KeyValue, request_id: str, check: Callable[[RequestRecord], bool], what: str, timeout_s: float = 30.0
) -> RequestRecord:
    """The request's record once ``check`` holds for it (read every 20 ms; a read the broker does
    not answer in time is read again: the broker goes quiet for seconds on a loaded box, see
    docs/reliability.md)."""

    async def holds() -> RequestRecord | None:
        with contextlib.suppress(KeyNotFoundError, NatsTimeoutError):
            rec = await record(kv, request_id)
            if check(rec):
                return rec
        return None

    return await until(holds, f"request {request_id}: {what}", timeout_s, every_s=0.02)


def moved(rec: RequestRecord) -> bool:
    """Stage 0 moved, and its new attempt's input was sent."""
    return len(rec.stages[0].attempts) > 1 and rec.stages[0].attempts[-1].sent_ns is not None


def ended(rec: RequestRecord) -> bool:
    return rec.status.terminal


async def records_at_end(kv: KeyValue, streams: Streams) -> dict[str, RequestRecord]:
    """Every stream's record once it has ended."""
    return {rid: await until_record(kv, rid, ended, "ended") for rid in streams.ids}


def judge_moves(
    streams: Streams,
    wire: Wire,
    records: dict[str, RequestRecord],
    moved_ids: set[str],
    attempts: list[tuple[int, int, str | None]],
    max_tokens: int,
) -> None:
    """Every stream completed with ``max_tokens`` tokens, each exactly once at its client; those
    of ``moved_ids`` (bound to the replica a fault struck) moved once, with ``attempts``. The
    others are not required to have run as one attempt (a box that starves the broker or a
    replica for a stall timeout makes an orchestrator judge a healthy replica stalled; the
    streams it moves must still be exact), but are printed when they moved."""
    for s in streams.seen:
        rec = records[s.id]
        assert s.error is None, s.error
        assert (s.usage_tokens, len(s.token_ids), s.finish_reason) == (max_tokens, max_tokens, "length"), s.id
        assert rec.status.value == "completed", rec
        if s.id in moved_ids:
            assert attempts_of(rec) == attempts, (s.id, attempts_of(rec))
        elif len(rec.stages[0].attempts) > 1:
            print(f"{s.id}, not on the fault's victim, moved too: {attempts_of(rec)}")
        assert s.token_ids == client_tokens(wire, rec), f"{s.id}: a token missing or repeated at the client"
