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

import openai
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from openai import AsyncOpenAI

from libs.common.envelopes import ClientEvent, ClientEventType, decode
from libs.common.records import RequestRecord

PROMPT = "Tell me everything about the sea."


@dataclass
class Seen:
    """What one client saw of its stream (``time.monotonic()`` readings)."""

    id: str = ""
    """The request id (the chunks' ``id``)."""
    token_ids: list[int] = field(default_factory=list)
    tokens: int | None = None
    """``usage.completion_tokens``."""
    finish_reason: str | None = None
    error: str | None = None
    last_at: float | None = None
    """When the last chunk with tokens arrived."""


async def stream_chat(client: AsyncOpenAI, model: str, seen: Seen, max_tokens: int) -> None:
    """One greedy streamed chat completion of ``max_tokens`` tokens (``ignore_eos``), recorded in
    ``seen``; an API error is recorded, not raised."""
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            seen.id = chunk.id
            if chunk.choices:
                ids = (chunk.choices[0].model_extra or {}).get("token_ids") or []
                if ids:
                    seen.token_ids += ids
                    seen.last_at = time.monotonic()
                seen.finish_reason = chunk.choices[0].finish_reason or seen.finish_reason
            if chunk.usage is not None:
                seen.tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        seen.error = f"{type(e).__name__}: {getattr(e, 'code', None)}: {e}"


async def until_tokens(seen: Seen, task: asyncio.Task[None], count: int, timeout_s: float = 120.0) -> None:
    """Wait until the client of ``seen`` has ``count`` tokens (fails if its stream ended first)."""
    deadline = time.monotonic() + timeout_s
    while len(seen.token_ids) < count:
        assert not task.done(), f"the stream ended with {len(seen.token_ids)} tokens: {seen.error}"
        assert time.monotonic() < deadline, f"{len(seen.token_ids)} tokens after {timeout_s} s"
        await asyncio.sleep(0.02)


@dataclass
class Streams:
    """Streams started together, each with its client's view and its task."""

    seen: list[Seen]
    tasks: list[asyncio.Task[None]]

    @classmethod
    async def start(
        cls, client: AsyncOpenAI, model: str, count: int, max_tokens: int, under_way: int = 20
    ) -> Streams:
        """``count`` streams of ``max_tokens`` tokens, returned once each client has ``under_way``."""
        seen = [Seen() for _ in range(count)]
        tasks = [asyncio.create_task(stream_chat(client, model, s, max_tokens)) for s in seen]
        for s, t in zip(seen, tasks, strict=True):
            await until_tokens(s, t, under_way)
        return cls(seen, tasks)

    async def finish(self, timeout_s: float = 180.0) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


@dataclass
class Wire:
    """Every client event of a pipeline as it passed the broker, with when it did."""

    events: dict[str, list[tuple[float, ClientEvent]]] = field(default_factory=dict)
    """Request id → (``time.monotonic()`` of arrival, event), in arrival order."""

    async def listen(self, nc: Client, pipeline: str) -> None:
        async def on_event(msg: Msg) -> None:
            event = decode(ClientEvent, msg.data)
            self.events.setdefault(event.request_id, []).append((time.monotonic(), event))

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


def moved_once_tokens(wire: Wire, rec: RequestRecord) -> list[int]:
    """The tokens the client of a request whose stage 0 moved once must have: the first
    ``resumed_tokens`` of attempt 1 as they went out (what the gateway said the client had), then
    every token attempt 2 sent. A token lost or repeated at the client makes its list differ."""
    first, second = rec.stages[0].attempts
    before = tokens_of(wire.text_events(rec.request_id, first.attempt))
    assert len(before) >= second.resumed_tokens, (len(before), second.resumed_tokens)
    return before[: second.resumed_tokens] + tokens_of(wire.text_events(rec.request_id, second.attempt))


def attempts_of(rec: RequestRecord) -> list[tuple[int, int, str | None]]:
    """(attempt, replica, reason) of each stage-0 attempt of the record."""
    return [(a.attempt, a.replica, a.reason) for a in rec.stages[0].attempts]


async def record(kv: KeyValue, request_id: str) -> RequestRecord:
    """The request's record in ``omni_requests`` (``kv``)."""
    return RequestRecord.model_validate_json((await kv.get(request_id)).value)


async def until_record(
    kv: KeyValue, request_id: str, check: Callable[[RequestRecord], bool], what: str, timeout_s: float = 30.0
) -> RequestRecord:
    """The request's record once ``check`` holds for it (read every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(KeyNotFoundError):
            rec = await record(kv, request_id)
            if check(rec):
                return rec
        await asyncio.sleep(0.02)
    raise AssertionError(f"request {request_id}: not {what} within {timeout_s} s")


def moved(rec: RequestRecord) -> bool:
    """Stage 0 moved, and its new attempt's input was sent."""
    return len(rec.stages[0].attempts) > 1 and rec.stages[0].attempts[-1].sent_ns is not None


def ended(rec: RequestRecord) -> bool:
    return rec.status.terminal


async def bound_to(kv: KeyValue, streams: Streams, replica: int) -> set[str]:
    """The streams whose stage 0 runs on thinker ``replica`` and has not finished there (read just
    before a fault strikes it)."""
    found = set()
    for s in streams.seen:
        rec = await record(kv, s.id)
        if rec.route[0] == replica and rec.stages[0].done_ns is None:
            found.add(s.id)
    return found


async def records_at_end(kv: KeyValue, streams: Streams) -> dict[str, RequestRecord]:
    """Every stream's record once it has ended."""
    return {s.id: await until_record(kv, s.id, ended, "ended") for s in streams.seen}


def judge_moves(
    streams: Streams,
    wire: Wire,
    records: dict[str, RequestRecord],
    moved_ids: set[str],
    attempts: list[tuple[int, int, str | None]],
    max_tokens: int,
) -> None:
    """Every stream completed with ``max_tokens`` tokens, each exactly once at its client; those
    of ``moved_ids`` (bound to the replica a fault struck) moved once with ``attempts``, the others
    ran as one attempt."""
    for s in streams.seen:
        rec = records[s.id]
        assert s.error is None, s.error
        assert (s.tokens, len(s.token_ids), s.finish_reason) == (max_tokens, max_tokens, "length"), s.id
        assert rec.status.value == "completed", rec
        if s.id in moved_ids:
            assert attempts_of(rec) == attempts, (s.id, attempts_of(rec))
            assert s.token_ids == moved_once_tokens(wire, rec), f"{s.id}: a token missing or repeated"
        else:
            assert len(rec.stages[0].attempts) == 1, (s.id, attempts_of(rec))
            assert s.token_ids == tokens_of(wire.text_events(s.id, 1)), f"{s.id}: a token missing or repeated"
