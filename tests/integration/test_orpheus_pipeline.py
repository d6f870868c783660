"""The Orpheus pipeline on this box: a real gateway, orchestrator and workers (tiny-thinker -> two
Orpheus talker replicas on tiny-orpheus -> code2wav on tiny-snac), the official ``openai`` client.

The ground truth comes from outside the code under test: the code chunks the talkers sent, seen on
the bus by a subscription of the test's own (core NATS hands every subscriber its own copy), and
a whole decode of each segment's frames made here from that capture.

a) A streamed audio request: the client's PCM is exactly the sent frames × 2,048 samples and equals
   the whole decode of each segment (within 1 PCM16 step, the codec tests' float32 tolerance).
b) The EngineCore of the talker holding a request is killed (``kill -9``, proven gone) mid-utterance,
   after a segment has ended, and the thinker goes on sending text chunks to its worker; the other
   replica takes over at the oldest unacknowledged text chunk, from the position the dead one noted
   in the record. The client's audio has no chunk missing or repeated and is exactly the fault-free
   run's samples. (The speech test kills a talker's whole worker.)
c) The metrics of a streamed request: the gateway's audio families and every worker's transfer
   families, scraped before and after, equal what the client received (its PCM at SNAC's 24 kHz, its
   own clock, its own real-time player) and what crossed the bus (frames, hops and bytes per edge).
d) A request's voice reaches the talker (the test's own runs in leo and tara differ).
e) ``/v1/audio/speech``: the input's sentences are the talker's input, spoken in the asked voice;
   every format streams and decodes (PyAV) to the frames the talker sent; a client that hangs up
   mid-stream stops the request in the talker and code2wav.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from benchmarks.process_table import descendants
from libs.common.bus import requests_kv
from libs.common.envelopes import StageTask
from libs.common.records import RequestRecord, RequestStatus, StageAttempt
from libs.models.tiny import resolve_model
from libs.stack.processes import until
from services.stage_worker.codecs import load_codec_adapter
from services.stage_worker.engine_health import ENGINE_DEAD_EXIT_STATUS
from tests.bus import holds_nothing
from tests.client_streams import record
from tests.e2e.test_metrics import Player, _check_player
from tests.e2e.test_speech import decoded
from tests.metrics_scrape import Samples, bucket_of, delta, scrape
from tests.orpheus_bus import (
    MODEL,
    PIPELINE,
    SUBJECTS,
    BusLog,
    Capture,
    fault_free_run,
    segments,
    stream_audio,
    stream_audio_timed,
)
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, ServiceProcess, gone, write_pipeline

pytestmark = pytest.mark.integration

FRAME_SAMPLES = 2048
"""PCM samples per SNAC 24 kHz frame (hop 512 × the coarsest stride 4)."""
CHUNK_FRAMES = 2
MAX_FRAMES_PER_CHAR, MIN_FRAMES = 0.1, 4
FAULT_TOKENS = 240
"""Thinker tokens of the move test's request: 15 text chunks of 16 tokens. The test holds the thinker
(SIGSTOP) once it has sent a few, until the talker is killed: the talker makes frames several times
slower than the thinker makes tokens, and a loaded box had it send all 126 chunks of 2,000 tokens
before the talker's second segment began."""
PAUSE_AFTER_CHUNKS = 3
"""Text chunks the move test lets the thinker send before it holds it: the talker's second segment
needs the second chunk's text, and its first code chunk frames past it."""
MOVE_VOICE = "leo"
"""The move test's voice, not the stage's default (tara): the attempt that takes the request over
reads it from the record, and speaks on in it."""
THINKER_HELD = THINKER_YAML + "    stall_timeout_s: 60\n"
"""The thinker, judged stalled only after a minute unanswered: the move test holds it for seconds."""
TALKERS_X2 = f"""\
  - name: talker
    type: llm
    model: tiny-orpheus
    replicas: 2
    consumes: text
    emits: codec_codes
    chunking: {{codes: {CHUNK_FRAMES}}}
    talker: {{protocol: orpheus, voice: tara, max_frames_per_char: {MAX_FRAMES_PER_CHAR}, min_frames: {MIN_FRAMES}}}
    engine: {{max_model_len: 2048, enforce_eager: true, dtype: float32}}
"""
CODE2WAV_SNAC = """\
  - name: code2wav
    type: codec
    model: tiny-snac
    consumes: codec_codes
    emits: audio
    stream_to_client: true
"""


WORKERS = {"thinker": (0, 0), "talker0": (1, 0), "talker1": (1, 1), "code2wav": (2, 0)}
"""The stack's workers: name → (stage, replica)."""


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real gateway, orchestrator, thinker, both Orpheus talkers and code2wav."""
    tmp = tmp_path_factory.mktemp("orpheus")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_HELD + TALKERS_X2 + CODE2WAV_SNAC)
    with Services(nats_server.url, path, tmp).start(workers=WORKERS.values()).serving() as services:
        yield services


def workers_of(stack: Services) -> dict[str, ServiceProcess]:
    """The stack's current workers by name (:data:`WORKERS`)."""
    return {name: stack.worker(*at) for name, at in WORKERS.items()}


@pytest.fixture(scope="module")
def snac():
    return load_codec_adapter(resolve_model("tiny-snac"))


@pytest.fixture
async def capture(nc) -> Capture:
    cap = Capture()
    await cap.listen(nc)
    return cap


def assert_is_whole_decode(pcm: bytes, chunks: list[StageTask], snac) -> None:
    """The client's PCM: exactly the sent frames' samples, each segment as its whole decode."""
    segs = segments(chunks)
    frames = sum(len(f) for _, f in segs)
    assert len(pcm) == 2 * frames * FRAME_SAMPLES
    whole = np.concatenate([snac.decode(f, first_frame=first) for first, f in segs])
    diff = np.abs(np.frombuffer(pcm, "<i2").astype(np.int32) - whole.astype(np.int32))
    assert diff.max() <= 1, f"{int((diff > 1).sum())} samples differ by more than 1 PCM16 step"


async def test_streamed_audio_is_every_sent_frame_decoded_as_whole_segments(stack, capture, snac) -> None:
    base_url = stack.base_url
    started = time.monotonic()
    pcm = await stream_audio(base_url, max_tokens=48)
    took = time.monotonic() - started
    (rid,) = capture.codes
    chunks = capture.chunks(rid)
    texts = [t for t in capture.text[rid] if t.text.strip()]
    segs = segments(chunks)
    # one segment per spoken text chunk, none longer than the protocol's cap for its text
    assert len(segs) == len(texts) > 1
    for (_, frames), t in zip(segs, texts, strict=True):
        assert 0 < len(frames) <= max(MIN_FRAMES, np.ceil(MAX_FRAMES_PER_CHAR * len(t.text.strip())))
    assert chunks[-1].final and all(not c.final for c in chunks[:-1])
    assert all(c.context_before <= 3 and c.context_after <= 3 for c in chunks)
    assert_is_whole_decode(pcm, chunks, snac)
    print(
        f"orpheus-tiny: {len(texts)} text chunks, {len(chunks)} code chunks, "
        f"{len(pcm) // 2 / 24000:.2f} s of audio in {took:.1f} s"
    )


SAMPLE_RATE = 24_000
"""SNAC 24 kHz's output rate, Hz (``sampling_rate`` of its published config)."""
AUDIO_STAGE = "2"
TTFP_SLACK_S = 0.25
"""How much later the client may see its first audio than the gateway's TTFP says: the client
measures from before sending (the openai client builds the request and connects) to the chunk's
arrival on loopback, the gateway from the HTTP arrival to writing it; typically a few ms more. The
box stalls a process for up to a few hundred ms now and then (tests/e2e/test_metrics.py takes the
median of five requests for that reason); one request here allows 0.25 s, a fraction of this
pipeline's TTFP (the thinker's first chunk and the talker's first frames come before it)."""
STAGE_SLACK_S = 0.1
"""How far the audio stage's generation time (its first input received → ``audio_done`` sent, on
its worker's clock) may differ from the same interval seen on the bus by the test's subscriber
(first message to the stage published → ``audio_done`` published): delivery to the worker and the
event loops of the worker and the subscriber."""


async def test_audio_and_transfer_metrics_are_what_the_client_and_the_bus_saw(stack, capture, nc) -> None:
    """The gateway's audio families and every worker's transfer families, read before and after one
    streamed request, against ground truth from outside them: the client's PCM and clock, the code
    chunks and hops a subscriber of the test's own saw on the bus."""
    base_url, workers = stack.base_url, workers_of(stack)
    bus = BusLog()
    await bus.listen(nc)
    gw = stack.gateway.metrics_url
    urls = {name: workers[name].metrics_url for name in WORKERS}
    before = await asyncio.to_thread(scrape, gw)
    before_w = {name: await asyncio.to_thread(scrape, url) for name, url in urls.items()}
    seen = await stream_audio_timed(base_url, max_tokens=48)
    rid = seen.id
    await until(lambda: rid in bus.audio_done, "audio_done seen on the bus")
    after = await until(
        lambda: _scraped_once(gw, before, "vllm:omni_audio_ttfp_s_count"), "the gateway counted the request"
    )
    after_w = {name: await asyncio.to_thread(scrape, url) for name, url in urls.items()}
    # code2wav counts its request time as its handler returns, after audio_done went out
    after_w["code2wav"] = await until(
        lambda: _scraped_once(urls["code2wav"], before_w["code2wav"], "vllm:omni_stage_request_s_count"),
        "code2wav counted the request",
    )
    labels = {"stage": AUDIO_STAGE, "replica": "0"}

    # frames and duration: exactly the client's samples, which are exactly the frames on the bus
    samples = len(np.frombuffer(bytes(seen.pcm), "<i2"))
    frames = sum(len(f) for _, f in segments(capture.chunks(rid)))
    assert samples == frames * FRAME_SAMPLES > 0
    assert delta(before, after, "vllm:omni_audio_frames_total", **labels) == samples
    assert delta(before, after, "vllm:omni_audio_duration_s_count", **labels) == 1
    duration = samples / SAMPLE_RATE
    assert delta(before, after, "vllm:omni_audio_duration_s_sum", **labels) == pytest.approx(
        duration, rel=1e-12
    )
    # one audio chunk to the client per code chunk with frames of its own
    own = [
        c
        for c in capture.chunks(rid)
        if len(c.codes.to_numpy().reshape(-1, 7)) > c.context_before + c.context_after
    ]
    assert len(seen.arrivals) == len(own)

    # TTFP: the gateway's arrival → first audio written, against the client's send → first audio
    assert delta(before, after, "vllm:omni_audio_ttfp_s_count", **labels) == 1
    ttfp = delta(before, after, "vllm:omni_audio_ttfp_s_sum", **labels)
    low, high = bucket_of(before, after, "vllm:omni_audio_ttfp_s", **labels)
    assert low < ttfp <= high
    assert 0 < ttfp <= seen.first_audio_s <= ttfp + TTFP_SLACK_S, (ttfp, seen.first_audio_s)

    # RTF: the audio stage's generation time / the duration, each part checked on its own
    assert delta(before, after, "vllm:omni_audio_rtf_count", **labels) == 1
    gen_s = delta(before, after, "vllm:omni_audio_rtf_sum", **labels) * duration
    window = bus.audio_done[rid] - bus.first_in[(rid, 2)]
    assert abs(gen_s - window) <= STAGE_SLACK_S, (gen_s, window)
    stage_s = delta(before_w["code2wav"], after_w["code2wav"], "vllm:omni_stage_request_s_sum")
    assert 0 <= stage_s - gen_s <= STAGE_SLACK_S, (stage_s, gen_s)  # counted after audio_done went out
    client_rtf = delta(before, after, "vllm:omni_audio_client_rtf_sum", **labels)
    assert gen_s / duration < client_rtf <= seen.e2e_s / duration

    # continuity: the gateway's player against the client's own (chunks timed as they arrived; it
    # plays at 24 kHz, SNAC's rate)
    _check_player(before, after, AUDIO_STAGE, Player.of(seen.arrivals))

    # transfers: one observation per hop into each worker, of the bytes that crossed the bus
    hops = bus.hops[rid]
    assert {e[2] for e in hops} == {"0", "1", "2"}
    for name, (stage, replica) in WORKERS.items():
        into = {e: sizes for e, sizes in hops.items() if (e[2], e[3]) == (str(stage), str(replica))}
        b, a = before_w[name], after_w[name]
        assert delta(b, a, "vllm:omni_transfer_size_bytes_count") == sum(len(s) for s in into.values()), name
        for (fs, fr, ts, tr), sizes in into.items():
            edge = {"from_stage": fs, "from_replica": fr, "to_stage": ts, "to_replica": tr}
            assert delta(b, a, "vllm:omni_transfer_size_bytes_sum", **edge) == sum(sizes), edge
            for part in ("size_bytes", "tx_s", "rx_s", "in_flight_s", "publish_s", "queue_wait_s"):
                assert delta(b, a, f"vllm:omni_transfer_{part}_count", **edge) == len(sizes), (part, edge)
    print(
        f"orpheus metrics: {frames} frames, {duration:.3f} s of audio in {len(own)} chunks; TTFP "
        f"{ttfp:.3f} s (client {seen.first_audio_s:.3f} s), RTF {gen_s / duration:.3f} "
        f"({gen_s:.3f} s; bus {window:.3f} s), client RTF {client_rtf:.3f}, hops {sum(map(len, hops.values()))}"
    )


async def _scraped_once(url: str, before: Samples, name: str) -> Samples | None:
    """A scrape of ``url`` once ``name`` grew by one since ``before``, else None."""
    got = await asyncio.to_thread(scrape, url)
    return got if delta(before, got, name) == 1 else None


async def test_a_talker_engine_killed_mid_utterance_moves_and_the_audio_is_the_fault_free_run(
    stack, capture, nc, snac
) -> None:
    """The talker's EngineCore is killed (``kill -9``, proven gone) once a later segment has begun,
    with the thinker held; then the thinker goes on at once, so text chunks reach the talker's
    worker after its engine died and before the orchestrator moved the request: the worker leaves
    them in the stream for the move, which sends them to the other replica (acknowledged there,
    they would be lost and the request would wait for them until its deadline). The worker exits
    with the engine-dead status.

    The fault-free run is the same talker input (the text chunks the thinker sent in the faulted
    run) sent again, after it, to the surviving talker: a chunk's text is the thinker's deltas' text,
    and where a delta of several tokens falls depends on timing, so a second chat request with the
    same greedy tokens may cut the same tokens into chunks with other texts."""
    base_url, workers = stack.base_url, workers_of(stack)
    thinker = workers["thinker"].proc.pid
    held: list[str] = []
    struck: list[tuple[str, int, int, list[StageTask]]] = []
    """(request, talker replica, its EngineCore's pid, the text chunks the thinker had sent) once killed."""

    def hold(rid: str, sent: list[StageTask]) -> None:
        """Stop the thinker's worker once it has sent a few text chunks, none of them the last."""
        if not held and len(sent) >= PAUSE_AFTER_CHUNKS and not any(t.final for t in sent):
            os.kill(thinker, signal.SIGSTOP)
            held.append(rid)

    def strike(rid: str, sent: list[tuple[int, StageTask]]) -> None:
        """Kill the talker's engine at once when it has sent the first chunk of a segment after the
        first one (a segment's first chunk goes out when ``after`` frames past it exist, with more
        to come), then let the thinker go on: the rest of the text reaches the dead engine's worker."""
        replica, last = sent[-1]
        if not struck and last.offset > 0 and last.context_before == 0 and last.context_after > 0:
            core = engine_core(workers[f"talker{replica}"].proc.pid)
            os.kill(core, signal.SIGKILL)
            struck.append((rid, replica, core, list(capture.text.get(rid, []))))
            os.kill(thinker, signal.SIGCONT)

    capture.on_text, capture.on_code = hold, strike
    task = asyncio.create_task(stream_audio(base_url, max_tokens=FAULT_TOKENS, voice=MOVE_VOICE))
    try:
        rid, replica, core, text_at_kill = (
            await until(lambda: struck, "a later segment begun", timeout_s=60, every_s=0.01)
        )[0]
    finally:
        os.kill(thinker, signal.SIGCONT)
    assert held == [rid], "the thinker was not held before the kill"
    await until(
        lambda: gone(core), f"talker {replica}'s EngineCore (pid {core}) gone after SIGKILL", timeout_s=5.0
    )
    assert not any(t.final for t in text_at_kill), (
        f"the thinker had sent every text chunk ({len(text_at_kill)}) before the kill"
    )
    pcm = await asyncio.wait_for(task, 120)
    worker = workers[f"talker{replica}"]
    assert await asyncio.to_thread(worker.proc.wait, 30) == ENGINE_DEAD_EXIT_STATUS
    moved_to, resent, chunks, texts = await judge_talker_move(
        nc, capture, snac, rid, replica, pcm, MOVE_VOICE, "engine_dead"
    )
    left = worker.text().count(f"request {rid}: chunk ")
    print(
        f"talker move: text chunk {moved_to.start_seq} redone on replica {1 - replica} ({resent} code chunks "
        f"sent again); {chunks} code chunks, {texts} text chunks, {len(text_at_kill)} sent at the kill, "
        f"{left} reached the dead engine's worker and were left for the move"
    )


def engine_core(worker_pid: int) -> int:
    """The pid of a talker worker's EngineCore process."""
    (core,) = [p for p in descendants(worker_pid) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()]
    return core


async def judge_talker_move(
    nc, capture: Capture, snac, rid: str, replica: int, pcm: bytes, voice: str, reason: str
) -> tuple[StageAttempt, int, int, int]:
    """The client's ``pcm`` of request ``rid``, whose talker replica ``replica`` was killed: every
    sent frame decoded as whole segments, no chunk missing or repeated, and exactly the fault-free
    run (the same talker input, run again by the test on the survivor in ``voice``); the talker ran
    as attempt 1 on ``replica`` then attempt 2 on the other (moved for ``reason``), which took over
    past text chunk 0.
    Returns (the new attempt, code chunks sent again, code chunks, text chunks)."""
    chunks = capture.chunks(rid)
    assert_is_whole_decode(pcm, chunks, snac)

    texts = {t.seq: t for t in capture.text[rid]}
    assert sorted(texts) == list(range(len(texts))) and texts[len(texts) - 1].final
    ref_id, reference = await fault_free_run(
        nc, [texts[s] for s in sorted(texts)], 1 - replica, capture, voice=voice
    )
    ref_chunks = capture.chunks(ref_id)
    assert len(ref_chunks) == len(chunks)
    for a, b in zip(ref_chunks, chunks, strict=True):
        assert (a.seq, a.offset, a.context_before, a.context_after) == (
            b.seq,
            b.offset,
            b.context_before,
            b.context_after,
        )
        np.testing.assert_array_equal(a.codes.to_numpy(), b.codes.to_numpy())
    assert pcm == reference, "audio unlike the fault-free run"

    ran = []
    for r, t in capture.codes[rid]:
        if not ran or ran[-1] != (r, t.from_attempt):
            ran.append((r, t.from_attempt))
    assert ran == [(replica, 1), (1 - replica, 2)], ran
    rec: RequestRecord = await record(await requests_kv(nc.jetstream()), rid)
    moved_to = rec.stages[1].attempts[-1]
    assert (moved_to.replica, moved_to.attempt, moved_to.reason) == (1 - replica, 2, reason)
    assert moved_to.start_seq >= 1, "the move restarted at text chunk 0: no position note was needed"
    return moved_to, len(capture.codes[rid]) - len(chunks), len(chunks), len(texts)


VOICE_TOKENS = 32
"""Thinker tokens of the voice test's request: two text chunks or more (16 tokens a chunk)."""


async def test_the_requested_voice_reaches_the_talker_and_an_unknown_one_is_refused(
    stack, capture, nc
) -> None:
    """An unknown voice is a 400 in OpenAI's shape and nothing reaches the requests stream. A request
    in voice leo is spoken in leo: the talker input the thinker sent for it (seen on the bus), run again
    by the test with leo in the record, gives the very code chunks and PCM the client got; run with
    tara (the stage's default, what ``alloy`` speaks in), other codes. Seeds are per text chunk, so
    only the voice differs between the runs."""
    base_url = stack.base_url
    js = nc.jetstream()
    published = (await js.stream_info(SUBJECTS.requests_stream)).state.last_seq
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "nobody", "format": "pcm16"},
            },
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "audio.voice",
        "invalid_value",
    )
    assert "'nobody'" in err["message"] and "leo" in err["message"]
    assert (await js.stream_info(SUBJECTS.requests_stream)).state.last_seq == published

    pcm = await stream_audio(base_url, max_tokens=VOICE_TOKENS, voice="leo")
    (rid,) = capture.codes
    rec = await record(await requests_kv(js), rid)
    assert rec.voice == "leo"
    texts = sorted(capture.text[rid], key=lambda t: t.seq)
    assert len(texts) > 1 and texts[-1].final

    def codes(request_id: str) -> list[np.ndarray]:
        return [t.codes.to_numpy() for t in capture.chunks(request_id)]

    talker = rec.stages[1].replica
    leo_id, leo_pcm = await fault_free_run(nc, texts, talker, capture, voice="leo")
    tara_id, tara_pcm = await fault_free_run(nc, texts, talker, capture, voice="tara")
    sent, leo, tara = codes(rid), codes(leo_id), codes(tara_id)
    assert len(sent) == len(leo) and all(np.array_equal(a, b) for a, b in zip(sent, leo, strict=True))
    assert pcm == leo_pcm, "the client's audio is not the talker input's in leo"
    assert not np.array_equal(np.concatenate(leo), np.concatenate(tara)) and leo_pcm != tara_pcm
    print(f"voice: {len(texts)} text chunks, {len(sent)} code chunks in leo; tara made other codes")


SPEECH_SENTENCES = ["The waves rolled in.", "Far away, a ship sailed on!", "Who saw it?"]
"""The speech test's input, sentence by sentence: the gateway sends each as one talker chunk."""


async def test_speech_in_a_voice_is_its_sentences_spoken_by_the_talker_in_it(stack, capture, nc) -> None:
    """``/v1/audio/speech`` with the official client: the talker's input (seen on the bus) is the
    input's sentences, in order, the last one final, sent by the orchestrator (the thinker is not
    run); the client's PCM is exactly the sent frames × 2,048 samples, and the test's own run of
    those sentences through the same talker in leo gives the very same PCM. An unknown voice is a
    400 ``invalid_voice`` and nothing is sent."""
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as refused:
        await client.audio.speech.create(model=MODEL, voice="nobody", input=" ".join(SPEECH_SENTENCES))
    assert (refused.value.code, refused.value.param) == ("invalid_voice", "voice")
    response = await client.audio.speech.create(
        model=MODEL, voice="leo", input=" ".join(SPEECH_SENTENCES), response_format="pcm"
    )
    await client.close()
    (rid,) = capture.text
    texts = sorted(capture.text[rid], key=lambda t: t.seq)
    assert [(t.seq, t.text, t.final) for t in texts] == [
        (i, s, i == len(SPEECH_SENTENCES) - 1) for i, s in enumerate(SPEECH_SENTENCES)
    ]
    rec = await record(await requests_kv(nc.jetstream()), rid)
    assert (rec.entry_stage, rec.route[0], rec.voice) == (1, -1, "leo")
    own = sum(
        len(c.codes.to_numpy().reshape(-1, 7)) - c.context_before - c.context_after
        for c in capture.chunks(rid)
    )
    assert len(response.content) == 2 * own * FRAME_SAMPLES
    _, reference = await fault_free_run(nc, texts, rec.stages[1].replica, capture, voice="leo")
    assert response.content == reference, "the client's speech is not its sentences spoken in leo"


SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


async def test_every_speech_format_streams_the_frames_the_talker_sent(stack, capture) -> None:
    """One streamed speech request per format, all at once, through the official client's
    ``with_streaming_response``: each body, decoded by PyAV (not the gateway's encoder), is mono
    audio as long as the frames the talker sent for that request (seen on the bus) × 2,048
    samples at 24 kHz: exactly for the lossless formats, within one SNAC frame for the lossy ones."""
    client = stack.client()

    async def one(fmt: str) -> tuple[str, bytes, int]:
        async with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="tara", input=" ".join(SPEECH_SENTENCES), response_format=fmt
        ) as response:
            reads, body = 0, bytearray()
            async for data in response.iter_bytes():
                reads, body = reads + 1, body + data
            return response.headers["x-request-id"], bytes(body), reads

    got = dict(zip(SPEECH_FORMATS, await asyncio.gather(*map(one, SPEECH_FORMATS)), strict=True))
    await client.close()
    for fmt, (rid, body, reads) in got.items():
        frames = sum(
            len(c.codes.to_numpy().reshape(-1, 7)) - c.context_before - c.context_after
            for c in capture.chunks(rid)
        )
        samples, rate, channels = decoded(body, fmt)
        assert channels == 1 and np.abs(samples).max() > 0.01, fmt
        if fmt in ("flac", "wav", "pcm"):
            assert (rate, len(samples)) == (SAMPLE_RATE, frames * FRAME_SAMPLES) and frames > 0, fmt
        else:  # Opus decodes at 48 kHz whatever went in: compare seconds
            seconds, expected_s = len(samples) / rate, frames * FRAME_SAMPLES / SAMPLE_RATE
            assert abs(seconds - expected_s) <= FRAME_SAMPLES / SAMPLE_RATE, (fmt, seconds, expected_s)
        assert reads > 1, f"{fmt}: the body came in one piece"


async def test_a_speech_client_that_hangs_up_mid_stream_stops_the_request_in_every_stage(
    stack, capture, nc
) -> None:
    """The client reads the first bytes of a long speech and closes the connection: the talker and
    code2wav replicas that held the request stop it and it ends aborted. Both held it (the talker
    sent code chunks, code2wav the client's first bytes); each then holds no request (its answer
    to the orchestrators' liveness probe) though neither finished its part (the talker never sent
    the last code chunk, and the record has no stage done)."""
    base_url = stack.base_url
    text = " ".join(f"Sentence number {i} rolls on like the sea." for i in range(12))
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"model": MODEL, "input": text, "voice": "tara", "response_format": "pcm"}
        async with http.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            async for chunk in r.aiter_raw():
                if chunk:
                    break
    talker = capture.codes[rid][0][0]
    for name in (f"talker{talker}", "code2wav"):
        idle = partial(holds_nothing, nc, SUBJECTS, *WORKERS[name])
        await until(idle, f"{name} holding no request ({rid} stopped)", timeout_s=30)
    sent = len(capture.codes[rid])
    await asyncio.sleep(0.5)  # a stopped talker sends nothing more
    assert len(capture.codes[rid]) == sent
    assert not any(t.final for _, t in capture.codes[rid]), "the talker finished the speech anyway"
    kv = await requests_kv(nc.jetstream())

    async def aborted() -> bool:
        return (await record(kv, rid)).status == RequestStatus.ABORTED

    await until(aborted, "the request's record aborted", timeout_s=10)
    rec = await record(kv, rid)
    assert [s.done_ns for s in rec.stages[1:]] == [None, None], "a stage finished its part anyway"


MOVE_SENTENCES = [f"Wave number {i} broke on the old stone pier." for i in range(8)]
"""The speech move test's input: eight sentences, eight segments."""


async def test_a_talker_killed_mid_speech_moves_and_the_audio_is_the_fault_free_run(
    stack, capture, nc, snac
) -> None:
    """A speech request has no thinker: its text chunks all wait in the talker's input from the
    start, and the move takes the dead replica's unacknowledged ones from the stream itself (no
    upstream to hold). Killed (``kill -9``, proven gone) once its second segment has begun, the
    talker's successor goes on from the position note, and the client's audio is exactly the
    fault-free run's in the asked voice."""
    workers = workers_of(stack)
    for name in ("talker0", "talker1"):  # the chat move test killed one: start it again
        if workers[name].proc.poll() is not None:
            stack.start_worker(*WORKERS[name])
    await stack.ready()  # the gateway's view among them: both talkers live
    workers = workers_of(stack)
    struck: list[tuple[str, int, int]] = []

    def strike(rid: str, sent: list[tuple[int, StageTask]]) -> None:
        replica, last = sent[-1]
        if not struck and last.offset > 0 and last.context_before == 0 and last.context_after > 0:
            pid = workers[f"talker{replica}"].proc.pid
            os.kill(pid, signal.SIGKILL)
            struck.append((rid, replica, pid))

    capture.on_code = strike
    client = stack.client()
    task = asyncio.create_task(
        client.audio.speech.create(
            model=MODEL, voice=MOVE_VOICE, input=" ".join(MOVE_SENTENCES), response_format="pcm"
        )
    )
    rid, replica, pid = (await until(lambda: struck, "a later segment begun", timeout_s=60, every_s=0.01))[0]
    await until(lambda: gone(pid), f"talker replica {replica} (pid {pid}) gone after SIGKILL", timeout_s=5.0)
    pcm = (await asyncio.wait_for(task, 120)).content
    await client.close()
    sent = {t.seq: t.text for t in capture.text[rid]}  # the moved copies too, by seq
    assert [sent[s] for s in sorted(sent)] == MOVE_SENTENCES
    moved_to, resent, chunks, texts = await judge_talker_move(
        nc, capture, snac, rid, replica, pcm, MOVE_VOICE, "exit"
    )
    print(
        f"speech talker move: text chunk {moved_to.start_seq} redone on replica {1 - replica} ({resent} code "
        f"chunks sent again); {chunks} code chunks, {texts} text chunks"
    )
