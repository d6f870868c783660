"""``/v1/realtime`` through a real pipeline (listener with its real Whisper model → mock thinker →
tiny talker → tiny code2wav) with the official ``openai`` client's realtime connection and real
speech (espeak-ng) streamed in 100 ms appends: the VAD's turn boundaries against where the speech
is in the audio sent, the transcript against the words spoken, the answer's audio against the
length the thinker's tokens make, G.711 input encoded and output decoded by FFmpeg (PyAV), barge-in and
``response.cancel`` ending a response within a second, a second turn carrying the first, and bad
events answered with ``error`` while the session lives on."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import time
from collections.abc import Iterator

import av
import httpx
import nats
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.envelopes import Liveness, decode
from libs.common.subjects import Subjects
from libs.stack.processes import until
from tests.pipeline_services import Services
from tests.procs import CODE2WAV_YAML, LISTENER_YAML, TALKER_YAML, mock_thinker_yaml, write_pipeline
from tests.realtime_events import until_event
from tests.speech import padded, recall, spoken

pytestmark = pytest.mark.e2e

PIPELINE = "rtalk"
STAGES_YAML = LISTENER_YAML + mock_thinker_yaml(inter_token_ms=2) + TALKER_YAML + CODE2WAV_YAML
SAID = "What is the weather like in Paris today?"
SAMPLES_PER_TOKEN = 4 * 480
"""The tiny talker makes 4 codes of each thinker token, code2wav 480 samples (24 kHz) of each code."""
APPEND_MS = 100
EVENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def stack(nats_server, otlp, tmp_path_factory) -> Iterator[Services]:
    """A real listener, mock thinker, tiny talker and code2wav, orchestrator and gateway, every one
    exporting its spans to the session's receiver."""
    tmp = tmp_path_factory.mktemp("rtalk")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML)
    traced = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    services = Services(nats_server.url, path, tmp, env=traced).start(workers=[(s, 0) for s in range(4)])
    with services.serving():
        yield services


@pytest.fixture(scope="module")
def speech_pcm(tmp_path_factory) -> tuple[bytes, float, float]:
    """24 kHz PCM16 of espeak-ng saying :data:`SAID` after 0.5 s of silence and before 1.5 s, and
    where the speech starts and ends in it (ms): its first and last sample above 1 % of full scale."""
    wav = padded(spoken(SAID, tmp_path_factory.mktemp("rt") / "s.wav").read_bytes(), 0.5, 1.5)
    with av.open(io.BytesIO(wav)) as c:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=24000)
        pcm = b"".join(p.to_ndarray().tobytes() for f in c.decode(audio=0) for p in resampler.resample(f))
    x = np.frombuffer(pcm, "<i2")
    loud = np.flatnonzero(np.abs(x) > 327)
    return pcm, loud[0] / 24.0, loud[-1] / 24.0


_until = functools.partial(until_event, timeout_s=EVENT_TIMEOUT_S)
"""The next event of a kind (:func:`tests.realtime_events.until_event`)."""


async def _speak(conn, pcm: bytes) -> list[tuple[float, float]]:
    """Append ``pcm`` in 100 ms pieces, faster than real time; (audio ms at each piece's end, when
    it was sent: ``time.monotonic()``)."""
    step, sent = 24 * 2 * APPEND_MS, []
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
        sent.append((min(i + step, len(pcm)) / 48, time.monotonic()))
        await asyncio.sleep(APPEND_MS / 1000 / 4)
    return sent


def _metrics(stack: Services) -> dict[str, float]:
    """The gateway's ``vllm:omni_realtime_*`` samples (name and labels → value)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(stack.metrics_url, timeout=5).text):
        for sample in fam.samples:
            if sample.name.startswith("vllm:omni_realtime"):
                out[sample.name + json.dumps(sample.labels, sort_keys=True)] = sample.value
    return out


async def _held(stack: Services) -> list[int]:
    """Requests the thinker, the talker and code2wav each hold (their liveness answers)."""
    nc = await nats.connect(stack.nats_url)
    try:
        alive = [await nc.request(Subjects(PIPELINE).alive(s, 0), b"", timeout=5) for s in (1, 2, 3)]
        return [decode(Liveness, a.data).in_flight for a in alive]
    finally:
        await nc.close()


def _value(metrics: dict[str, float], name: str, **labels: str) -> float:
    model = {"model_name": f"{PIPELINE}-model", **labels}
    return metrics.get(name + json.dumps(model, sort_keys=True), 0.0)


async def test_a_spoken_turn_is_heard_and_answered_in_audio(stack, speech_pcm) -> None:
    pcm, start_ms, end_ms = speech_pcm
    async with stack.client().realtime.connect(model=stack.model) as conn:
        created = await _until(conn, "session.created")
        assert created.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 24})
        await _until(conn, "session.updated")
        await _speak(conn, pcm)
        started = await _until(conn, "input_audio_buffer.speech_started")
        stopped = await _until(conn, "input_audio_buffer.speech_stopped")
        assert started.audio_start_ms == pytest.approx(start_ms, abs=100)
        assert stopped.audio_end_ms == pytest.approx(end_ms, abs=100)
        assert stopped.item_id == started.item_id
        heard = await _until(conn, "conversation.item.input_audio_transcription.completed")
        assert heard.item_id == started.item_id and recall(heard.transcript, SAID) >= 0.7, heard.transcript
        events: list = []
        done = await _until(conn, "response.done", events)
    assert done.response.status == "completed"
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    tokens = done.response.usage.output_tokens
    assert tokens == 24 and transcript
    assert len(audio) // 2 == tokens * SAMPLES_PER_TOKEN, "every thinker token spoken, once"
    assert done.response.output[0].content[0].transcript == transcript


async def test_text_in_text_out_and_the_second_turn_carries_the_first(stack) -> None:
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        usages = []
        for question in ("Hello there.", "And then?"):
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": question}],
                }
            )
            await _until(conn, "conversation.item.done")
            await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 8})
            events: list = []
            done = await _until(conn, "response.done", events)
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert done.response.status == "completed" and text, done.response.status_details
            assert done.response.output[0].content[0].text == text
            usages.append(done.response.usage)
    first, second = usages
    assert second.input_tokens > first.input_tokens + first.output_tokens, (
        "the first turn is in the second prompt"
    )


def _g711(pcm24k: bytes, codec_name: str) -> bytes:
    """``pcm24k`` (24 kHz PCM16) as FFmpeg encodes it in G.711 (``pcm_mulaw``/``pcm_alaw``) at 8 kHz."""
    frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm24k, "<i2")[None, :], format="s16", layout="mono")
    frame.sample_rate = 24000
    resampler = av.AudioResampler(format="s16", layout="mono", rate=8000)
    codec = av.CodecContext.create(codec_name, "w")
    codec.sample_rate, codec.layout, codec.format = 8000, "mono", "s16"
    frames = [*resampler.resample(frame), *resampler.resample(None)]
    return b"".join(bytes(p) for f in [*frames, None] for p in codec.encode(f))


@pytest.mark.parametrize(("fmt", "codec_name"), [("audio/pcmu", "pcm_mulaw"), ("audio/pcma", "pcm_alaw")])
async def test_g711_in_is_heard_and_g711_out_decodes_with_ffmpeg_to_the_tokens_length(
    stack, speech_pcm, fmt, codec_name
) -> None:
    pcm, _, _ = speech_pcm
    g711 = {"format": {"type": fmt}}
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        session = {"type": "realtime", "max_output_tokens": 10, "audio": {"input": g711, "output": g711}}
        await conn.session.update(session=session)
        await _until(conn, "session.updated")
        law = _g711(pcm, codec_name)
        for i in range(0, len(law), 800):  # 100 ms at 8 kHz, one byte a sample
            await conn.input_audio_buffer.append(audio=base64.b64encode(law[i : i + 800]).decode())
            await asyncio.sleep(APPEND_MS / 1000 / 4)
        heard = await _until(conn, "conversation.item.input_audio_transcription.completed")
        assert recall(heard.transcript, SAID) >= 0.7, heard.transcript
        events: list = []
        done = await _until(conn, "response.done", events)
    law_out = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    codec = av.CodecContext.create(codec_name, "r")
    codec.sample_rate, codec.layout = 8000, "mono"
    samples = sum(f.samples for f in codec.decode(av.Packet(law_out)))
    expected = done.response.usage.output_tokens * SAMPLES_PER_TOKEN // 3
    assert abs(samples - expected) <= 8, (samples, expected)


async def test_a_cancelled_response_ends_within_a_second(stack) -> None:
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Talk a lot."}],
            }
        )
        await conn.response.create(response={"max_output_tokens": 600})
        await _until(conn, "response.output_audio.delta")
        before = _value(_metrics(stack), "vllm:omni_realtime_interruptions_total", cause="client_cancelled")
        t0 = time.monotonic()
        await conn.response.cancel()
        done = await _until(conn, "response.done")
        assert time.monotonic() - t0 < 1.0
    assert done.response.status == "cancelled"
    assert done.response.status_details.reason == "client_cancelled"
    after = _value(_metrics(stack), "vllm:omni_realtime_interruptions_total", cause="client_cancelled")
    assert after == before + 1
    assert done.response.usage is None or done.response.usage.output_tokens < 600


async def test_caller_speech_interrupts_the_answer(stack, speech_pcm) -> None:
    pcm, _, _ = speech_pcm
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        # the caller's speech only interrupts: no answer to it follows, so every stage goes idle
        vad = {"type": "server_vad", "create_response": False}
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": vad}}})
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}
        )
        await conn.response.create(response={"max_output_tokens": 600})
        events: list = []
        await _until(conn, "response.output_audio.delta", events)
        talker, code2wav = (await _held(stack))[1:]
        assert talker == code2wav == 1, "the answer is being spoken"
        before = _value(_metrics(stack), "vllm:omni_realtime_interruptions_total", cause="turn_detected")
        await _speak(conn, pcm)
        await _until(conn, "input_audio_buffer.speech_started", events)
        t0 = time.monotonic()
        done = await _until(conn, "response.done", events)
        assert time.monotonic() - t0 < 1.0
        truncated = await _until(conn, "conversation.item.truncated", events)
        # every stage let the answer go: the abort reached each of them
        async with asyncio.timeout(1.0):
            while await _held(stack) != [0, 0, 0]:
                await asyncio.sleep(0.05)
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
    sent = sum(len(base64.b64decode(e.delta)) for e in events if e.type == "response.output_audio.delta")
    assert truncated.item_id == done.response.output[0].id
    assert truncated.audio_end_ms == sent * 1000 // (24000 * 2)
    after = _value(_metrics(stack), "vllm:omni_realtime_interruptions_total", cause="turn_detected")
    assert after == before + 1


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("{not json", "invalid_json"),
        ('{"type": "no.such.event"}', "invalid_event_type"),
        ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value"),
        ('{"type": "conversation.item.delete", "item_id": "nope", "event_id": "e1"}', "item_not_found"),
        ('{"type": "response.cancel"}', "response_cancel_not_active"),
        ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
    ],
)
async def test_a_bad_event_is_an_error_event_and_the_session_lives_on(stack, raw, code) -> None:
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        await conn.send_raw(raw)
        error = await _until(conn, "error")
        assert error.error.code == code and error.error.type == "invalid_request_error"
        await conn.session.update(session={"type": "realtime", "instructions": "still here"})
        updated = await _until(conn, "session.updated")
        assert updated.session.instructions == "still here"


async def test_an_upgrade_for_another_model_is_refused(stack) -> None:
    with pytest.raises(Exception) as e:  # the client raises the websockets library's InvalidStatus
        async with stack.client().realtime.connect(model="gpt-realtime") as conn:
            await conn.recv()
    assert "404" in str(e.value)


async def test_a_turn_is_one_trace_and_the_metrics_match_what_the_client_measured(
    stack, speech_pcm, otlp
) -> None:
    """Voice-to-voice latency as the gateway counts it (the audio that ended the speech arriving →
    the first audio delta sent) against the client's own (that audio sent → the first delta
    received): the gateway's can only be shorter, by the socket's two crossings. One trace holds
    the turn: its root, the listener's request and the response's, every stage's span."""
    pcm, _, _ = speech_pcm
    before = _metrics(stack)
    async with stack.client().realtime.connect(model=stack.model) as conn:
        await _until(conn, "session.created")
        opened = _value(_metrics(stack), "vllm:omni_realtime_sessions")
        assert opened == _value(before, "vllm:omni_realtime_sessions") + 1
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8})
        sent = await _speak(conn, pcm)
        stopped = await _until(conn, "input_audio_buffer.speech_stopped")
        await _until(conn, "response.output_audio.delta")
        first_audio = time.monotonic()
        await _until(conn, "response.done")
    ended = next(t for end_ms, t in sent if end_ms >= stopped.audio_end_ms)
    client_s = first_audio - ended
    after = await until(
        lambda: (
            (m := _metrics(stack))
            and _value(m, "vllm:omni_realtime_sessions") == _value(before, "vllm:omni_realtime_sessions")
            and m
        ),
        "the session counted closed",
    )
    count = "vllm:omni_realtime_voice_to_voice_s_count"
    assert _value(after, count) == _value(before, count) + 1
    gateway_s = _value(after, "vllm:omni_realtime_voice_to_voice_s_sum") - _value(
        before, "vllm:omni_realtime_voice_to_voice_s_sum"
    )
    assert client_s - 0.1 <= gateway_s <= client_s, (gateway_s, client_s)

    def whole() -> list | None:
        roots = [
            s
            for s in otlp.spans
            if s.name == "realtime turn" and s.attributes.get("omnirelay.realtime.item") == stopped.item_id
        ]
        for root in roots:  # a transcription begun at an earlier pause and dropped has its own trace
            spans = otlp.trace(root.trace_id)
            stages = {s.attributes.get("omnirelay.stage") for s in spans if s.name.startswith("omni.stage ")}
            if stages == {0, 1, 2, 3}:
                return spans
        return None

    spans = await until(whole, "the turn's trace with every stage's span", timeout_s=15)
    assert [s.name for s in spans if not s.parent_span_id] == ["realtime turn"], "one root"
    names = {s.name for s in spans}
    assert {f"transcription {stack.model}", f"chat {stack.model}", "omni.stage listener"} <= names


async def test_the_realtime_bench_measures_turns_as_a_caller_sends_them(stack, speech_pcm) -> None:
    """``omnirelay bench realtime``'s measurement, bounded: two sessions of one turn each, sent in
    real time."""
    from benchmarks.realtime_latency import measure

    pcm, _, _ = speech_pcm
    listener = stack.worker(0).metrics_url
    level = await measure(f"{stack.base_url}/v1", stack.model, pcm, 2, 1, 8, [listener])
    assert [t.status for t in level.turns] == ["completed", "completed"]
    assert len(level.latencies) == 2 and all(0.5 <= v < 10 for v in level.latencies), level.latencies
    assert level.rtf is not None and 0 < level.rtf[0] <= level.rtf[1], (
        level.rtf
    )  # (not a speed claim: CI shares the box)


async def test_text_streamed_into_speech_is_spoken_chunk_by_chunk_as_it_comes(stack) -> None:
    """``/v1/audio/speech/stream`` with vLLM-Omni's messages: the text sent word by word, the first
    sentence's audio arrives before the rest of the text is sent, each chunk's audio is as long as
    its tokens make (the thinker's tokenizer, word by word, as the gateway cuts them)."""
    import websockets
    from transformers import AutoTokenizer

    from libs.models.tiny import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-thinker"))
    sentences = ["The tide came in.", "Gulls cried over the harbour!", "Then it was quiet"]
    url = stack.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "alloy", "response_format": "pcm"}))
        for word in sentences[0].split():
            await ws.send(json.dumps({"type": "input.text", "text": word + " "}))
        first = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
        assert first == {
            "type": "audio.start",
            "sentence_index": 0,
            "sentence_text": sentences[0],
            "format": "pcm",
        }
        for word in " ".join(sentences[1:]).split():
            await ws.send(json.dumps({"type": "input.text", "text": word + " "}))
        await ws.send(json.dumps({"type": "input.done"}))
        audio: dict[int, int] = {0: 0}
        texts, index = {0: first["sentence_text"]}, 0
        while True:
            message = await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S)
            if isinstance(message, bytes):
                audio[index] += len(message)
                continue
            event = json.loads(message)
            if event["type"] == "audio.start":
                index = event["sentence_index"]
                audio[index], texts[index] = 0, event["sentence_text"]
            elif event["type"] == "session.done":
                break
            else:
                assert event == {"type": "audio.done", "sentence_index": index}, event
    assert event["total_sentences"] == 3 and [texts[i] for i in range(3)] == sentences
    words = " ".join(sentences).split()
    spaced = iter([words[0], *(" " + w for w in words[1:])])  # as the gateway tokenizes them
    for i, sentence in enumerate(sentences):
        tokens = sum(len(tok.encode(next(spaced), add_special_tokens=False)) for _ in sentence.split())
        assert audio[i] == 2 * tokens * SAMPLES_PER_TOKEN, (i, audio[i], tokens)


async def test_a_bad_stream_message_is_an_error_and_the_stream_goes_on(stack) -> None:
    import websockets

    url = stack.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "ogg-vorbis"}))
        bad_format = json.loads(await ws.recv())
        assert bad_format["type"] == "error" and bad_format["param"] == "response_format", bad_format
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        await ws.send("not json")
        assert json.loads(await ws.recv())["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "input.bogus"}))
        assert json.loads(await ws.recv())["code"] == "invalid_event_type"
        await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
        await ws.send(json.dumps({"type": "input.done"}))
        kinds = []
        while not kinds or kinds[-1] != "session.done":
            message = await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S)
            if not isinstance(message, bytes):
                kinds.append(json.loads(message)["type"])
    assert kinds == ["audio.start", "audio.done", "session.done"]
