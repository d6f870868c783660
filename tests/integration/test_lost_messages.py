"""Messages the bus loses or does not take, with a real gateway, a real orchestrator, a real thinker
worker and the official ``openai`` client (docs/reliability.md, "Who notices what"):

- **a client event lost on the way** (in the middle of a stream, or its last one, which no later
  event shows missing), with the gateway's first answers to the worker's questions lost too: the
  worker, which keeps its events until the gateway confirms them, sends the lost one again and the
  client gets every token exactly once, in order, from the one attempt; a gap is counted in
  ``vllm:omni_client_event_gaps_total``;
- **a lifecycle event no stream takes** (no stream listens on its subject, as while a cluster
  elects a stream's leader: "no response from stream"): the worker publishes it again until a
  stream takes it, and the request's record ends with it instead of waiting for its deadline.

A real part cannot drop one core-NATS message on demand, so the first fault is made by a proxy
between the worker and nats-server (:class:`LossyLink`) that forwards the NATS protocol verbatim
except one client event and some answers to the worker's questions. Everything else is real. The
second fault is made on the real broker: the events stream stops listening on
``omni.<p>.events.finished`` for a while (a stream update)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from urllib.parse import urlparse

import pytest
from nats.js.errors import NoStreamResponseError
from openai import AsyncOpenAI

from benchmarks.chat_streams import send
from libs.common.bus import requests_kv
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    MalformedMessage,
    ResumePoint,
    decode,
    pack_batch,
    unpack_batch,
)
from libs.common.publish import STORE_RETRY_MAX_S
from libs.common.subjects import BATCH_TOKEN, EVENT_KINDS, Subjects
from libs.stack.local_nats import free_port
from tests.client_streams import (
    PROMPT,
    Seen,
    Wire,
    attempts_of,
    ended,
    record,
    tokens_of,
    until_record,
)
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "lostmsgs"
MODEL = f"{PIPELINE}-model"
SUBJECTS = Subjects(PIPELINE)
GATEWAY = "gwlostmsgs"
STREAMS, LONG = 4, 600
"""Streams under way together when the client event is lost, and their tokens."""
INTER_TOKEN_MS = 5
"""The thinker runs on the mock engine (``engine.mock``: the real worker and publishing path, no
model compute), paced at this many ms per token, so each stream lasts ~3 s on any box, however
long its lost event takes to be sent again: what is judged here is the bus, the worker's delivery
and the gateway, not the engine."""
STAGES_YAML = THINKER_YAML.replace(
    "dtype: float32}", f"dtype: float32, mock: {{inter_token_ms: {INTER_TOKEN_MS}}}}}"
)
DROP_SEQ = 3
"""The ``seq`` of the client event the link loses in the middle of a stream."""
ANSWERS_LOST = 2
"""Answers to the worker's questions the link loses after it lost the event."""

Frame = tuple[int, str | None, bytes]
"""(bytes the frame takes, its subject, its payload without headers); the subject is None for a
protocol line without payload."""


def _frame(buf: bytearray) -> Frame | None:
    """The first whole frame of NATS client-protocol bytes ``buf``, None while incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    parts = bytes(buf[:end]).split()
    op = parts[0].upper() if parts else b""
    if op not in (b"PUB", b"HPUB", b"MSG", b"HMSG"):
        return end + 2, None, b""
    size = int(parts[-1])  # PUB/MSG: payload bytes; HPUB/HMSG: header + payload bytes
    taken = end + 2 + size + 2
    if len(buf) < taken:
        return None
    payload = bytes(buf[end + 2 : end + 2 + size])
    if op in (b"HPUB", b"HMSG"):
        payload = payload[int(parts[-2]) :]
    return taken, parts[1].decode(), payload


class LossyLink:
    """A TCP proxy between NATS clients and nats-server, on a thread of its own (the services keep
    talking while a test's sync code blocks). It forwards every byte except the messages that
    ``lose_sent`` (client → server) or ``lose_received`` (server → client) choose, given their
    subject and payload: True loses the message, bytes replace a published message's payload (it
    is sent as a ``PUB`` without reply or headers: a worker's batch of client events, less the
    lost one)."""

    def __init__(
        self,
        server_url: str,
        lose_sent: Callable[[str, bytes], bool | bytes],
        lose_received: Callable[[str, bytes], bool],
    ) -> None:
        self.server_port = urlparse(server_url).port
        self.port = free_port()
        self.lose_sent, self.lose_received = lose_sent, lose_received
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lossy-link", daemon=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> LossyLink:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", self.port), self._loop
        ).result(5)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.server_port)
        pumps = [
            asyncio.create_task(self._pump(client_r, server_w, self.lose_sent)),
            asyncio.create_task(self._pump(server_r, client_w, self.lose_received)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (client_w, server_w):
            w.close()

    @staticmethod
    async def _pump(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, lose: Callable[[str, bytes], bool | bytes]
    ) -> None:
        buf = bytearray()
        while data := await src.read(1 << 16):
            buf += data
            out = bytearray()
            while (frame := _frame(buf)) is not None:
                taken, subject, payload = frame
                verdict = False if subject is None else lose(subject, payload)
                if verdict is False:
                    out += buf[:taken]
                elif verdict is not True:
                    out += b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(verdict), verdict)
                del buf[:taken]
            dst.write(bytes(out))
            await dst.drain()


@dataclass
class LostEvent:
    """The link's fault: the first client event that ``pick`` chooses, of the first stage-0
    attempt that sends one while armed (a copy sent again passes), then the next
    :data:`ANSWERS_LOST` answers to the worker's questions."""

    pick: Callable[[ClientEvent], bool] | None = None
    """Armed while set."""
    lost: ClientEvent | None = None
    answers_lost: int = 0

    def arm(self, pick: Callable[[ClientEvent], bool]) -> None:
        self.pick, self.lost, self.answers_lost = pick, None, 0

    def sent(self, subject: str, payload: bytes) -> bool | bytes:
        """Lose the event: its message, or its place in a worker's batch (the rest go on)."""
        if self.pick is None or self.lost is not None or not subject.startswith(f"omni.{PIPELINE}.out."):
            return False
        batched = subject.endswith(f".{BATCH_TOKEN}")
        try:
            bodies = unpack_batch(payload) if batched else [payload]
            events = [decode(ClientEvent, body) for body in bodies]
        except MalformedMessage:  # a worker's question
            return False
        for i, event in enumerate(events):
            if event.stage == 0 and event.attempt == 1 and self.pick(event):
                self.lost = event
                return pack_batch(bodies[:i] + bodies[i + 1 :]) if batched else True
        return False

    def received(self, subject: str, payload: bytes) -> bool:
        """Lose an answer to a question of the worker (a reply on its inbox), after the event."""
        if self.lost is None or self.answers_lost >= ANSWERS_LOST or not subject.startswith("_INBOX."):
            return False
        try:
            decode(ResumePoint, payload)
        except MalformedMessage:  # a JetStream reply
            return False
        self.answers_lost += 1
        return True


@pytest.fixture(scope="module")
def fault() -> LostEvent:
    """The link's fault, armed by a test."""
    return LostEvent()


@pytest.fixture(scope="module")
def stack(nats_server, fault: LostEvent, tmp_path_factory) -> Iterator[Services]:
    """Gateway and orchestrator on the session's nats-server, the thinker worker through a
    :class:`LossyLink` to it."""
    tmp = tmp_path_factory.mktemp("lostmsgs")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML, timeout_s=120)
    link = LossyLink(nats_server.url, fault.sent, fault.received).start()
    try:
        services = Services(nats_server.url, path, tmp).start(gateway_env={"OMNIRELAY_INSTANCE_ID": GATEWAY})
        services.start_worker(0, 0, {"VLLM_CPU_KVCACHE_SPACE": "1"}, nats_url=link.url)
        with services.serving():
            yield services
    finally:
        link.stop()


@contextlib.asynccontextmanager
async def client_of(stack: Services) -> AsyncIterator[AsyncOpenAI]:
    """The official client, after one request has gone through the stack (the engine's first
    request is slow; the orchestrator's registry view may not have the worker yet)."""
    client = stack.client(180)
    try:
        for _ in range(60):
            warm = Seen()
            await send(client, MODEL, warm, PROMPT, 8)
            if warm.error is None:
                break
            await asyncio.sleep(0.5)
        assert warm.error is None, warm.error
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize(
    "where",
    ["middle", "last"],
)
async def test_a_lost_client_event_is_sent_again_by_its_worker(stack, fault, nc, where) -> None:
    """An event lost in the middle of a stream leaves a gap the gateway sees; the last one
    (``text_done``) leaves none. Either way the worker, asking until the gateway has every event,
    sends it again: no move, every token once."""
    wire = Wire()
    await wire.listen(nc, PIPELINE)
    kv = await requests_kv(nc.jetstream())
    async with client_of(stack) as client:
        before = scrape(stack.metrics_url), scrape(stack.orchestrator.metrics_url)
        if where == "middle":
            fault.arm(lambda e: e.type == ClientEventType.TEXT and e.seq == DROP_SEQ)
        else:
            fault.arm(lambda e: e.type == ClientEventType.TEXT_DONE)
        seen = [Seen() for _ in range(STREAMS)]
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(send(client, MODEL, s, PROMPT, LONG) for s in seen)), 180)
        took_s = time.monotonic() - t0
        after = scrape(stack.metrics_url), scrape(stack.orchestrator.metrics_url)
    fault.pick = None
    lost = fault.lost
    assert lost is not None, "the link lost no client event: the fault did not happen"
    assert fault.answers_lost == ANSWERS_LOST, "the worker asked the gateway too few times"
    for s in seen:
        assert s.error is None, s.error
        assert (s.usage_tokens, len(s.token_ids), s.finish_reason) == (LONG, LONG, "length"), s.id
        rec = await until_record(kv, s.id, ended, "ended")
        assert attempts_of(rec) == [(1, 0, None)], "a stream moved"
        assert s.token_ids == tokens_of(wire.text_events(s.id, 1)), (
            "a token missing or repeated at the client"
        )
    copies = [e for _, e in wire.events[lost.request_id] if (e.attempt, e.seq) == (lost.attempt, lost.seq)]
    assert copies == [lost], "the lost event was not sent again (once it reached the broker)"
    gaps = delta(before[0], after[0], "vllm:omni_client_event_gaps_total", stage="0")
    assert gaps == (1 if where == "middle" else 0)
    assert delta(before[1], after[1], "vllm:omni_requests_migrated_total") == 0
    print(
        f"lost event {lost.seq} ({lost.type.value}) of {lost.request_id}; {STREAMS} streams in {took_s:.1f} s"
    )


HOLD_S = 3.0
"""How long no stream takes ``finished`` events, seconds (the worker's tries come
``STORE_RETRY_S`` apart, doubling to ``STORE_RETRY_MAX_S``: about four tries meanwhile)."""
LATE_S = 3.0
"""Slack for a loaded box on top of the longest gap between two tries, seconds."""


async def test_a_lifecycle_event_no_stream_takes_is_published_again_until_one_does(stack, fault, nc) -> None:
    js = nc.jetstream()
    kv = await requests_kv(js)
    fault.pick = None
    config = (await js.stream_info(SUBJECTS.events_stream)).config
    listening = [SUBJECTS.event(k) for k in EVENT_KINDS if k != "finished"]
    async with client_of(stack) as client:
        seen = Seen()
        await js.update_stream(replace(config, subjects=listening))
        try:
            with pytest.raises(NoStreamResponseError):  # the fault holds: no stream takes the subject
                await js.publish(SUBJECTS.event("finished"), b"", timeout=2)
            await send(client, MODEL, seen, PROMPT, 64)
            done = time.monotonic()
            while time.monotonic() - done < HOLD_S:
                rec = await record(kv, seen.id)
                assert not rec.status.terminal, f"the record ended with no finished event stored: {rec}"
                await asyncio.sleep(0.1)
        finally:
            await js.update_stream(config)
        restored = time.monotonic()
        rec = await until_record(kv, seen.id, ended, "ended", timeout_s=15)
        ended_after_s = time.monotonic() - restored
    assert seen.error is None, seen.error
    assert (seen.usage_tokens, len(seen.token_ids), seen.finish_reason) == (64, 64, "length")
    assert (rec.status.value, rec.finish_reason) == ("completed", "length"), rec
    assert "finished.0.1" in rec.events
    # Only the worker's next try can have stored it: tries are at most STORE_RETRY_MAX_S apart.
    assert ended_after_s <= STORE_RETRY_MAX_S + LATE_S, f"the record ended {ended_after_s:.2f} s after"
    print(f"the record ended {ended_after_s:.2f} s after the stream listened again")
