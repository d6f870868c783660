"""Gateway request checks, WAV encoding and the launcher's process plan."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import pytest

from cli.launcher import plan_services
from libs.common.pipeline import load_pipeline
from services.gateway.audio import encode_whole
from services.gateway.errors import APIError
from services.gateway.prompting import audio_parts, chat_messages, max_tokens_for, sampling_for, wants_audio
from services.gateway.schemas import ChatCompletionRequest


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    assert max_tokens_for(None, 100, 2048, "max_tokens") == 1948
    assert max_tokens_for(1948, 100, 2048, "max_tokens") == 1948


@pytest.mark.parametrize(
    ("asked", "prompt", "code"),
    [
        (0, 10, "invalid_request"),
        (-5, 10, "invalid_request"),
        (1949, 100, "context_length_exceeded"),
        (None, 2048, "context_length_exceeded"),
    ],
)
def test_max_tokens_outside_the_context_is_a_400(asked, prompt, code) -> None:
    with pytest.raises(APIError) as e:
        max_tokens_for(asked, prompt, 2048, "max_tokens")
    assert (e.value.status, e.value.code) == (400, code)


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}
    )


def test_audio_is_requested_through_modalities() -> None:
    p = load_pipeline()
    assert wants_audio(_req(), p) is None
    assert wants_audio(_req(modalities=["text", "audio"]), p).format == "wav"
    for fmt in ("pcm16", "mp3", "flac", "opus"):
        audio = {"voice": "v", "format": fmt}
        assert wants_audio(_req(modalities=["text", "audio"], audio=audio), p).format == fmt
    for bad, param in (
        (dict(modalities=["image"]), "modalities"),
        (dict(modalities=["audio"], audio={"format": "aac"}), "audio.format"),  # not a chat format
    ):
        with pytest.raises(APIError) as e:
            wants_audio(_req(**bad), p)
        assert (e.value.status, e.value.param) == (400, param)


def test_audio_needs_an_audio_stage() -> None:
    text_only = load_pipeline(Path(load_pipeline().source).with_name("text-only.yaml"))
    with pytest.raises(APIError, match="produces no audio"):
        wants_audio(_req(modalities=["text", "audio"]), text_only)


def test_chat_messages_flatten_text_parts_and_reject_others() -> None:
    req = _req(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert chat_messages(req.messages, {}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    with pytest.raises(APIError) as e:
        chat_messages(_req(messages=[{"role": "user", "content": [{"type": "image_url"}]}]).messages, {})
    assert e.value.param == "messages.0.content.0.type"


def test_audio_parts_become_what_the_listener_heard_in_their_place() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    msgs = _req(messages=[{"role": "user", "content": [{"type": "text", "text": "Q: "}, audio]}]).messages
    assert list(audio_parts(msgs)) == [(0, 1)]
    assert chat_messages(msgs, {(0, 1): "what time is it"}) == [
        {"role": "user", "content": "Q: what time is it"}
    ]
    with pytest.raises(APIError) as e:
        audio_parts(_req(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]).messages)
    assert e.value.param == "messages.0.content.0.input_audio"


def test_sampling_stop_strings_and_n() -> None:
    assert sampling_for(_req(stop="."), 5).stop == ["."]
    with pytest.raises(APIError, match="n=1"):
        sampling_for(_req(n=3), 5)


def test_wav_header_matches_the_pcm() -> None:
    pcm = bytes(range(256)) * 10
    with wave.open(io.BytesIO(encode_whole("wav", pcm, 24_000))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (
            1,
            2,
            24_000,
            len(pcm) // 2,
        )
        assert w.readframes(w.getnframes()) == pcm


def test_launcher_plans_one_process_per_replica_with_the_same_environment() -> None:
    p = load_pipeline()
    specs = plan_services(p, Path("/x.yaml"), "nats://n:1", 8123, log_stats=True)
    assert [s.name for s in specs] == [
        "orchestrator",
        "listener-0",
        "thinker-0",
        "thinker-1",
        "talker-0",
        "code2wav-0",
        "gateway",
    ]
    assert all(s.env["NATS_URL"] == "nats://n:1" and s.env["OMNIRELAY_LOG_STATS"] == "true" for s in specs)
    assert specs[3].args == ["worker"] and (
        specs[3].env["OMNIRELAY_STAGE"],
        specs[3].env["OMNIRELAY_REPLICA"],
    ) == ("1", "1")
    assert specs[-1].env["OMNIRELAY_PORT"] == "8123"
