"""Metrics agree with what the client saw and with what crossed the bus (stack runs --log-stats).

Each test reads the exposition before and after its own requests and compares the difference
with ground truth measured independently: the client's clock, decoded audio and its own player
simulation (of the chunks as they arrived), and the stage messages and client events captured on
the bus by a subscriber of our own (what each stage received and sent, and when).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import nats
import openai
import pytest

from libs.common import headers as h
from libs.common.envelopes import StageTask, decode
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier, request_record, snapshot
from tests.bus import client_events
from tests.metrics_scrape import Samples, delta, scrape, total
from tests.procs import process_state, stop_confirmed, worker_pid

pytestmark = pytest.mark.e2e

SR = 24_000
LATENCY_SLACK_S = 0.1
"""The client measures from before sending to after reading: at most this much more than the
gateway's arrival → last byte written, on loopback (typically ~2 ms more). The machine can stall
a process for a few hundred ms now and then (seen in CI: one request of three at +0.32 s, one
audio request's first audio at +0.16 s), so the checks take the median gap of several requests.
(Two of three audio requests at +0.16 s and +0.45 s were vLLM's busy-waiting engines starving the
gateway and the client: see services/stage_worker/engine_core/wait_plugin.py.)"""
PLAYER_SLACK_S = 0.15
"""How much one silence of the client's player (chunks timed as they arrived) may differ from the
same silence of the gateway's (chunks timed as written): the delivery delays of two chunks on
loopback differ by a few ms on a quiet box, but on the loaded 2-core CI box the client once took a
stream's first chunk 113 ms later than a later one (fresh-clone CI of 98a8446, 2026-12-06: the
gateway's silence 1.145 s, the player's 1.032 s). Where the client's silence is this close to a
threshold, the gateway's may fall on either side of it."""
STAGE_SLACK_S = 0.1
"""How far a stage's own time for a request (first input received → handler done) may differ from
the same interval seen by the test's subscriber on the bus (first input published → last output
published): JetStream's delivery to the worker, the subscriber's and the worker's event loops."""
PAUSE_S = 1.5
"""How long the audio stage is stopped mid-stream (beyond the audio that still arrives meanwhile):
three times a chunk's 0.5 s of audio, far inside its ``stall_timeout_s``."""
WAIT_S = 10.0
"""How long a worker may take to count what the client has already seen (it observes its request
time after its handler returns, which is after the client got the last byte)."""


@pytest.fixture(scope="module")
def gw(stack) -> str:
    return f"{stack.admin_url}/metrics"


@pytest.fixture(scope="module")
def worker_urls(stack, pipeline) -> dict[tuple[int, int], str]:
    snap = asyncio.run(snapshot(stack.nats_url, pipeline))
    return {
        (s["stage"], s["replica"]): s["metrics_url"] for s in snap["services"] if s["service"] == "worker"
    }


def scrape_until(url: str, ok, timeout_s: float = WAIT_S) -> Samples:
    """Scrape ``url`` until ``ok(samples)`` or the timeout; returns the last scrape (assert on it)."""
    deadline = time.monotonic() + timeout_s
    got = scrape(url)
    while not ok(got) and time.monotonic() < deadline:
        time.sleep(0.1)
        got = scrape(url)
    return got


# --- ground truth: the bus as a subscriber of our own sees it --------------------------------------
@dataclass
class Seen:
    """One request on the bus (``time.monotonic()`` of the test process when each message came)."""

    first_in: dict[int, float] = field(default_factory=dict)
    """Stage → when the first message to it was published."""
    last_out: dict[int, float] = field(default_factory=dict)
    """Stage → when its last output (a message downstream or a client event) was published."""
    bytes: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    """(from_stage, from_replica, to_stage, to_replica) → bytes of the messages on that edge."""
    hops: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))

    def window(self, stage: int) -> float:
        return self.last_out[stage] - self.first_in[stage]


class BusWatch:
    """Every stage message and client event of the pipeline, per request id.

    The subscriber runs on an event loop of its own in its own thread, so that its timestamps
    do not wait for the test's loop (which parses the client's stream meanwhile)."""

    def __init__(self, nats_url: str, pipeline) -> None:
        self.url, self.subjects = nats_url, Subjects(pipeline.name)
        self.seen: dict[str, Seen] = defaultdict(Seen)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bus-watch", daemon=True)

    def _on_own_loop(self, coro) -> asyncio.Future:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def __aenter__(self) -> BusWatch:
        self._thread.start()
        await self._on_own_loop(self._subscribe())
        return self

    async def _subscribe(self) -> None:
        self.nc = await nats.connect(self.url)
        await self.nc.subscribe(self.subjects.stages_wildcard, cb=self._on_stage)
        await self.nc.subscribe(self.subjects.out("*", "*"), cb=self._on_event)
        await barrier(self.nc)

    async def __aexit__(self, *exc) -> None:
        await self._on_own_loop(self.nc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()

    async def _on_stage(self, msg) -> None:
        now, hdr = time.monotonic(), msg.headers or {}
        s = self.seen[decode(StageTask, msg.data).request_id]
        edge = (hdr[h.FROM_STAGE], hdr[h.FROM_REPLICA], hdr[h.TO_STAGE], hdr[h.TO_REPLICA])
        s.bytes[edge] += len(msg.data)
        s.hops[edge] += 1
        s.first_in.setdefault(int(edge[2]), now)
        if edge[0] != h.FROM_ORCHESTRATOR:
            s.last_out[int(edge[0])] = now

    async def _on_event(self, msg) -> None:
        now = time.monotonic()
        for ev in client_events(msg):
            if ev.stage is not None:
                self.seen[ev.request_id].last_out[ev.stage] = now

    async def settle(self, rid: str, timeout_s: float = WAIT_S) -> dict:
        """Wait until every stage of ``rid``'s route is done (its record says so; a stage is done
        after it sent every output), then until everything sent before has reached us. Returns
        the record."""
        deadline = time.monotonic() + timeout_s
        while True:
            rec = await request_record(self.url, rid)
            if rec and all(st["done_ns"] for st in rec["stages"]):
                break
            assert time.monotonic() < deadline, f"{rid}: not every stage done within {timeout_s} s: {rec}"
            await asyncio.sleep(0.05)
        await self._on_own_loop(barrier(self.nc))
        return rec


# --- ground truth: the client's own player ----------------------------------------------------------
@dataclass
class Player:
    """A listener that starts playing at the first chunk's arrival and plays on in real time: each
    chunk's margin is how long after the buffered audio ran out it arrived (> 0: a silence)."""

    margins: list[float]

    @classmethod
    def of(cls, arrivals: list[tuple[float, int]]) -> Player:
        """``arrivals``: (``time.monotonic()`` when it arrived, PCM16 bytes) per audio chunk."""
        margins, dry_at = [], None
        for t, nbytes in arrivals:
            seconds = nbytes / 2 / SR
            if dry_at is not None:
                margins.append(t - dry_at)
            dry_at = (t if dry_at is None else max(t, dry_at)) + seconds
        return cls(margins)

    @property
    def worst_silence_s(self) -> float:
        return max([0.0, *self.margins])

    def late_chunks(self) -> tuple[int, int]:
        """The fewest and most chunks the gateway may have counted as late (``PLAYER_SLACK_S``)."""
        return sum(m > PLAYER_SLACK_S for m in self.margins), sum(m > -PLAYER_SLACK_S for m in self.margins)

    def continuous(self, threshold_ms: int) -> set[int]:
        """The continuity counts (0 or 1) the gateway may have made for ``threshold_ms``."""
        gap = self.worst_silence_s - threshold_ms / 1000
        return {1} if gap < -PLAYER_SLACK_S else {0} if gap > PLAYER_SLACK_S else {0, 1}


def _check_player(before: Samples, after: Samples, stage: str, player: Player) -> None:
    """The gateway's continuity families for one stream against the client's own player."""
    assert delta(before, after, "vllm:omni_audio_streams_total", stage=stage) == 1
    assert delta(before, after, "vllm:omni_audio_underrun_s_count", stage=stage) == 1
    silence = delta(before, after, "vllm:omni_audio_underrun_s_sum", stage=stage)
    assert abs(silence - player.worst_silence_s) <= PLAYER_SLACK_S, (silence, player.margins)
    fewest, most = player.late_chunks()
    late = delta(before, after, "vllm:omni_audio_late_chunks_total", stage=stage)
    assert fewest <= late <= most, (late, player.margins)
    for ms in (50, 100, 200):
        ok = delta(before, after, "vllm:omni_audio_continuity_ok_total", stage=stage, threshold_ms=str(ms))
        assert ok in player.continuous(ms), (ms, ok, player.margins)


# --- the tests -----------------------------------------------------------------------------------------
def test_finish_reasons_and_e2e_latency_match_the_client(stack, pipeline, gw) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    model = pipeline.served_model_name
    sizes = (3, 9, 5, 7, 4)
    first = before = scrape(gw)
    gaps = []
    for n in sizes:
        t0 = time.monotonic()
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=n,
            extra_body={"ignore_eos": True},
        )
        client_s = time.monotonic() - t0
        assert r.choices[0].finish_reason == "length"
        after = scrape(gw)
        assert delta(before, after, "vllm:omni_e2e_request_latency_s_count") == 1
        server_s = delta(before, after, "vllm:omni_e2e_request_latency_s_sum")
        assert 0 < server_s <= client_s, (n, client_s, server_s)
        gaps.append(client_s - server_s)
        before = after
    assert statistics.median(gaps) <= LATENCY_SLACK_S, gaps
    assert delta(
        first, after, "vllm:omni_requests_success_total", finished_reason="length", model_name=model
    ) == len(sizes)
    assert delta(first, after, "vllm:omni_requests_success_total") == len(sizes)  # no other reason


def test_running_gauge_counts_a_stream_while_it_is_open(stack, pipeline, gw) -> None:
    """While the client reads a long stream, the gateway counts it running (not waiting); after
    the stream's end, neither."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    idle = scrape(gw)
    assert total(idle, "vllm:omni_num_requests_running") == 0, "another request runs: the test cannot count"
    stream = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "Count to a thousand."}],
        max_tokens=600,  # ~2.5 s of the tiny thinker's tokens: open long after its first one
        stream=True,
        extra_body={"ignore_eos": True},
    )
    # The client may read far behind the gateway on a loaded box, so a single scrape after the
    # first token can come after the gateway has sent the last one: scrape while reading, and
    # the gauge must have shown this stream (and only it) at least once, and never more.
    during = []
    for n, c in enumerate(stream):
        if n % 100 == 0 and any(ch.delta.content for ch in c.choices):
            during.append(scrape(gw))
    after = scrape(gw)
    running = [total(d, "vllm:omni_num_requests_running") for d in during]
    assert running and max(running) == 1, running
    assert all(total(d, "vllm:omni_num_requests_waiting") == 0 for d in during)
    assert total(after, "vllm:omni_num_requests_running") == 0
    assert total(after, "vllm:omni_num_requests_waiting") == 0


@dataclass
class AudioSeen:
    """One streamed text+audio request as its client saw it (seconds after sending)."""

    id: str = ""
    pcm: bytearray = field(default_factory=bytearray)
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    """(``time.monotonic()`` at arrival, PCM16 bytes) of every audio chunk."""
    first_audio: float | None = None
    e2e: float = 0.0


async def _audio_request(
    client: openai.AsyncOpenAI, model: str, max_tokens: int = 40, on_audio=None
) -> AudioSeen:
    """One streamed text+audio request; ``on_audio(seen)`` after each audio chunk arrived (it must
    not block: the reader records each chunk's arrival as it comes)."""
    seen = AudioSeen()
    t0 = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Read me a story."}],
        max_tokens=max_tokens,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        seen.id = chunk.id
        for c in chunk.choices:
            if c.delta.audio and c.delta.audio.data:
                now = time.monotonic()
                data = base64.b64decode(c.delta.audio.data)
                seen.first_audio = seen.first_audio or now - t0
                seen.pcm += data
                seen.arrivals.append((now, len(data)))
                if on_audio is not None:
                    on_audio(seen)
    seen.e2e = time.monotonic() - t0
    return seen


async def test_audio_metrics_match_the_decoded_audio_and_client_timing(
    stack, pipeline, gw, worker_urls
) -> None:
    client = stack.client(120)
    stage = str(pipeline.audio_stage)
    audio_worker = worker_urls[(pipeline.audio_stage, 0)]
    gaps = []
    async with BusWatch(stack.nats_url, pipeline) as bus:
        for _ in range(5):
            # Scrapes run off the event loop: the bus subscriber timestamps what it sees meanwhile.
            before, before_w = (
                await asyncio.to_thread(scrape, gw),
                await asyncio.to_thread(scrape, audio_worker),
            )
            seen = await _audio_request(client, pipeline.served_model_name)
            after = await asyncio.to_thread(scrape, gw)
            await bus.settle(seen.id)
            frames = len(seen.pcm) // 2
            assert frames > 0 and seen.first_audio is not None
            assert delta(before, after, "vllm:omni_audio_frames_total", stage=stage) == frames
            duration = frames / SR
            assert delta(before, after, "vllm:omni_audio_duration_s_sum", stage=stage) == pytest.approx(
                duration
            )
            ttfp = delta(before, after, "vllm:omni_audio_ttfp_s_sum", stage=stage)
            assert delta(before, after, "vllm:omni_audio_ttfp_s_count", stage=stage) == 1
            assert 0 < ttfp <= seen.first_audio, (seen.first_audio, ttfp)
            gaps.append(seen.first_audio - ttfp)
            # The RTF (docs/contract.md, "Metrics: names and labels") is the audio stage's own
            # generation time / duration: its first input → its last output, which the bus shows
            # (the worker reports the same interval as its request time, a little later). The
            # client's RTF counts from the HTTP arrival; the client's own clock bounds it.
            window = bus.seen[seen.id].window(pipeline.audio_stage)
            rtf = delta(before, after, "vllm:omni_audio_rtf_sum", stage=stage)
            assert delta(before, after, "vllm:omni_audio_rtf_count", stage=stage) == 1
            assert abs(rtf * duration - window) <= STAGE_SLACK_S, (rtf * duration, window)
            client_rtf = delta(before, after, "vllm:omni_audio_client_rtf_sum", stage=stage)
            assert rtf < client_rtf <= seen.e2e / duration, (rtf, client_rtf, seen.e2e / duration)
            after_w = await asyncio.to_thread(
                scrape_until,
                audio_worker,
                lambda w, b=before_w: delta(b, w, "vllm:omni_stage_request_s_count") == 1,
            )
            assert delta(before_w, after_w, "vllm:omni_stage_request_s_count") == 1
            stage_s = delta(before_w, after_w, "vllm:omni_stage_request_s_sum")
            assert abs(stage_s - window) <= STAGE_SLACK_S, (stage_s, window)
            _check_player(before, after, stage, Player.of(seen.arrivals))
    await client.close()
    assert statistics.median(gaps) <= LATENCY_SLACK_S, gaps


SPEECH_INPUT = "The tide came in. Gulls cried over the harbour!"


async def test_speech_requests_count_in_the_audio_families_as_their_client_heard_them(
    stack, pipeline, gw
) -> None:
    """A ``/v1/audio/speech`` request streamed as raw PCM (the talker is its first stage): the
    gateway's audio families against the bytes and the clock of the client, and the stage's own
    generation time against the bus."""
    client = stack.client(120)
    stage = str(pipeline.audio_stage)
    async with BusWatch(stack.nats_url, pipeline) as bus:
        before = await asyncio.to_thread(scrape, gw)
        seen = AudioSeen()
        t0 = time.monotonic()
        async with client.audio.speech.with_streaming_response.create(
            model=pipeline.served_model_name, voice="alloy", input=SPEECH_INPUT, response_format="pcm"
        ) as response:
            seen.id = response.headers["x-request-id"]
            async for data in response.iter_bytes():
                now = time.monotonic()
                seen.first_audio = seen.first_audio or now - t0
                seen.pcm += data
                seen.arrivals.append((now, len(data)))
        seen.e2e = time.monotonic() - t0
        after = await asyncio.to_thread(
            scrape_until, gw, lambda g: delta(before, g, "vllm:omni_e2e_request_latency_s_count") == 1
        )
        rec = await bus.settle(seen.id)
    await client.close()
    assert rec["entry_stage"] == pipeline.speech_stage and rec["status"] == "completed", rec
    frames = len(seen.pcm) // 2
    assert frames > 0 and len(seen.pcm) % 2 == 0
    assert delta(before, after, "vllm:omni_audio_frames_total", stage=stage) == frames
    assert delta(before, after, "vllm:omni_audio_duration_s_count", stage=stage) == 1
    duration = frames / SR
    assert delta(before, after, "vllm:omni_audio_duration_s_sum", stage=stage) == pytest.approx(duration)
    assert delta(before, after, "vllm:omni_audio_ttfp_s_count", stage=stage) == 1
    ttfp = delta(before, after, "vllm:omni_audio_ttfp_s_sum", stage=stage)
    assert 0 < ttfp <= seen.first_audio, (seen.first_audio, ttfp)
    assert delta(before, after, "vllm:omni_audio_rtf_count", stage=stage) == 1
    window = bus.seen[seen.id].window(pipeline.audio_stage)
    rtf = delta(before, after, "vllm:omni_audio_rtf_sum", stage=stage)
    assert abs(rtf * duration - window) <= STAGE_SLACK_S, (rtf * duration, window)
    client_rtf = delta(before, after, "vllm:omni_audio_client_rtf_sum", stage=stage)
    assert rtf < client_rtf <= seen.e2e / duration, (rtf, client_rtf, seen.e2e / duration)
    assert delta(before, after, "vllm:omni_audio_streams_total", stage=stage) == 1
    assert delta(before, after, "vllm:omni_audio_underrun_s_count", stage=stage) == 1
    server_s = delta(before, after, "vllm:omni_e2e_request_latency_s_sum")
    assert 0 < server_s <= seen.e2e, (server_s, seen.e2e)
    # the thinker never saw it: no hop into it, and the talker's first input came from admission
    assert pipeline.thinker_stage not in bus.seen[seen.id].first_in, bus.seen[seen.id]


async def test_a_player_that_runs_dry_is_counted_as_discontinuous(stack, pipeline, gw) -> None:
    """The audio stage (its only replica) is stopped (``SIGSTOP``) after a stream's first audio
    chunk for ``PAUSE_S`` plus the duration of the audio that still arrives meanwhile: the client's
    own player runs dry (the fault happened), and the gateway's continuity families say what that
    player heard."""
    assert pipeline.stages[pipeline.audio_stage].replicas == 1
    client = stack.client(120)
    pid = worker_pid(stack.proc.pid, pipeline.audio_stage, 0)
    stage = str(pipeline.audio_stage)
    stopped: list[float] = []  # when the stage was stopped

    async def pause(seen: AudioSeen) -> None:
        """Runs beside the reader, which goes on recording what arrives meanwhile."""
        try:
            await stop_confirmed(pid, "the audio stage", timeout_s=1.0)
            stopped.append(time.monotonic())
            while time.monotonic() < stopped[0] + PAUSE_S + sum(
                n / 2 / SR for t, n in seen.arrivals if t > stopped[0]
            ):
                await asyncio.sleep(0.01)
        finally:
            os.kill(pid, signal.SIGCONT)

    pauses: list[asyncio.Task] = []

    def on_audio(seen: AudioSeen) -> None:
        if not pauses:
            pauses.append(asyncio.create_task(pause(seen)))

    before = await asyncio.to_thread(scrape, gw)
    try:
        seen = await _audio_request(client, pipeline.served_model_name, 60, on_audio=on_audio)
    finally:
        await asyncio.gather(*pauses)
    after = await asyncio.to_thread(scrape, gw)
    await client.close()
    assert stopped and process_state(pid) != "T"
    player = Player.of(seen.arrivals)
    assert player.worst_silence_s > 0.2 + PLAYER_SLACK_S, ("the player did not run dry", player.margins)
    assert delta(before, after, "vllm:omni_audio_frames_total", stage=stage) == len(seen.pcm) // 2
    _check_player(before, after, stage, player)
    assert delta(before, after, "vllm:omni_audio_late_chunks_total", stage=stage) >= 1


async def test_transfer_sizes_equal_the_bytes_on_the_bus(stack, pipeline, worker_urls) -> None:
    before = {k: scrape(u) for k, u in worker_urls.items()}
    async with (
        BusWatch(stack.nats_url, pipeline) as bus,
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http,
    ):
        body = {
            "model": pipeline.served_model_name,
            "messages": [{"role": "user", "content": "bytes"}],
            "max_tokens": 30,
            "ignore_eos": True,
            "modalities": ["text", "audio"],
        }
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        rid = r.json()["id"]
        await bus.settle(rid)
    seen = bus.seen[rid]
    ran = {str(i) for i in range(pipeline.thinker_stage, len(pipeline.stages))}
    assert {e[2] for e in seen.bytes} == ran  # orchestrator → thinker → talker → code2wav
    hops_to = defaultdict(int)
    for (_fs, _fr, ts, tr), n in seen.hops.items():
        hops_to[(int(ts), int(tr))] += n
    for key, url in worker_urls.items():
        # Every hop into each worker is counted once, and none that did not happen.
        after = scrape_until(
            url,
            lambda w, k=key: delta(before[k], w, "vllm:omni_transfer_size_bytes_count") == hops_to.get(k, 0),
        )
        assert delta(before[key], after, "vllm:omni_transfer_size_bytes_count") == hops_to.get(key, 0), key
        for (fs, fr, ts, tr), nbytes in seen.bytes.items():
            if (int(ts), int(tr)) != key:
                continue
            labels = dict(from_stage=fs, from_replica=fr, to_stage=ts, to_replica=tr)
            hops = seen.hops[(fs, fr, ts, tr)]
            assert delta(before[key], after, "vllm:omni_transfer_size_bytes_sum", **labels) == nbytes
            assert delta(before[key], after, "vllm:omni_transfer_size_bytes_count", **labels) == hops
            for part in ("tx", "rx", "in_flight", "publish", "queue_wait"):
                assert delta(before[key], after, f"vllm:omni_transfer_{part}_s_count", **labels) == hops


async def test_every_stage_reports_the_time_a_request_spent_in_it(stack, pipeline, worker_urls) -> None:
    before = {k: scrape(u) for k, u in worker_urls.items()}
    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "stages"}],
        "max_tokens": 40,
        "ignore_eos": True,
        "modalities": ["text", "audio"],
    }
    async with (
        BusWatch(stack.nats_url, pipeline) as bus,
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http,
    ):
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json=body)
        client_s = time.monotonic() - t0
        assert r.status_code == 200
        rec = await bus.settle(r.json()["id"])
    seen = bus.seen[rec["request_id"]]
    for s, replica in enumerate(rec["route"]):
        if replica < 0:  # a stage the request skipped (the listener)
            continue
        key = (s, replica)
        # A worker counts the request as its handler returns (after its last output).
        after = await asyncio.to_thread(
            scrape_until,
            worker_urls[key],
            lambda w, k=key: delta(before[k], w, "vllm:omni_stage_request_s_count") == 1,
        )
        assert delta(before[key], after, "vllm:omni_stage_request_s_count") == 1, key
        took = delta(before[key], after, "vllm:omni_stage_request_s_sum")
        window = seen.window(s)
        print(f"stage {s}: reported {took * 1000:.0f} ms, on the bus {window * 1000:.0f} ms")
        assert abs(took - window) <= STAGE_SLACK_S, (s, took, window)
        assert took <= client_s  # nothing spends longer in a stage than the client waited
    for key, url in worker_urls.items():
        if key[1] != rec["route"][key[0]]:  # the replicas the request was not routed to saw nothing
            assert delta(before[key], scrape(url), "vllm:omni_stage_request_s_count") == 0, key


def test_every_worker_exports_its_stage_identity(pipeline, worker_urls) -> None:
    assert set(worker_urls) == {(s, r) for s, st in enumerate(pipeline.stages) for r in range(st.replicas)}
    for (s, r), url in worker_urls.items():
        st = pipeline.stages[s]
        got = scrape(url)
        assert (
            total(
                got,
                "vllm:omni_stage_info",
                stage=str(s),
                replica=str(r),
                stage_name=st.name,
                stage_type=st.type.value,
                model=st.model,
            )
            == 1
        )
        assert total(got, "vllm:omni_stage_info") == 1  # its own identity only
