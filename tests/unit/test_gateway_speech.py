"""``POST /v1/audio/speech`` up to the bus, through the gateway's real route and error handlers (the
pipeline client records the admission and refuses it, as in test_gateway_voice.py), and the
orchestrator's input for a request that enters at the talker."""

from __future__ import annotations

import base64

import pytest
from transformers import AutoTokenizer

from libs.common.envelopes import Admission, SpeechChunk, TaskKind
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, load_pipeline
from libs.models.tiny import resolve_model
from services.orchestrator.admission import entry_tasks
from tests.speech import silence_wav
from tests.unit.test_gateway_voice import ORPHEUS_VOICES, REFUSED, _gateway, _orpheus, tokenizer  # noqa: F401

INPUT = "The sea was calm. Was it? Yes, calm as glass!"
SENTENCES = ["The sea was calm.", "Was it?", "Yes, calm as glass!"]


def _speech(pipeline, **fields) -> dict:
    return {"model": pipeline.served_model_name, "input": INPUT, "voice": "alloy", **fields}


async def test_a_speech_request_enters_at_the_talker_with_its_sentences(tokenizer) -> None:  # noqa: F811
    pipeline = _orpheus()
    http, client = _gateway(pipeline, tokenizer)
    r = await http.post("/v1/audio/speech", json=_speech(pipeline, voice="leo", response_format="flac"))
    assert r.status_code == REFUSED, r.text
    ((adm),) = client.published
    # The reference tokens: the thinker's tokenizer loaded here, not the gateway's wrapper.
    reference = AutoTokenizer.from_pretrained(resolve_model(pipeline.thinker.model))
    assert adm.entry_stage == pipeline.speech_stage and pipeline.stages[adm.entry_stage].name == "talker"
    assert adm.audio and adm.voice == "leo" and adm.sampling is None and adm.prompt_token_ids == []
    assert adm.text_chunks == [
        SpeechChunk(text=s, token_ids=reference.encode(s, add_special_tokens=False)) for s in SENTENCES
    ]


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"input": ""}, 400, "input", "invalid_request"),
        ({"input": " \n "}, 400, "input", "empty_input"),
        ({"input": "a" * 4097}, 400, "input", "invalid_request"),
        ({"response_format": "ogg"}, 400, "response_format", "invalid_request"),
        ({"speed": 0.2}, 400, "speed", "invalid_request"),
        ({"speed": 4.5}, 400, "speed", "invalid_request"),
        ({"stream_format": "chunks"}, 400, "stream_format", "invalid_request"),
        ({"voice": "nobody"}, 400, "voice", "invalid_voice"),
        ({"model": "tts-1"}, 404, "model", "model_not_found"),
    ],
)
async def test_bad_input_is_a_4xx_in_openai_shape_and_nothing_is_published(
    tokenizer,  # noqa: F811
    fields,
    status,
    param,
    code,
) -> None:
    pipeline = _orpheus()
    http, client = _gateway(pipeline, tokenizer)
    r = await http.post("/v1/audio/speech", json=_speech(pipeline, **fields))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert client.published == []


async def test_a_pipeline_without_a_listener_cannot_hear(tokenizer) -> None:  # noqa: F811
    """Chat audio parts and transcriptions are a 400 naming why on a pipeline with no listener;
    nothing is queued."""
    pipeline = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("text-only.yaml"))
    http, client = _gateway(pipeline, tokenizer)
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(silence_wav(0.5)).decode(), "format": "wav"},
    }
    body = {"model": pipeline.served_model_name, "messages": [{"role": "user", "content": [part]}]}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages", "unsupported_content")
    files = {"file": ("a.wav", silence_wav(0.5), "audio/wav")}
    r = await http.post("/v1/audio/transcriptions", data={"model": pipeline.served_model_name}, files=files)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("model", "transcription_unsupported")
    assert client.published == []


async def test_a_pipeline_without_a_talker_cannot_speak(tokenizer) -> None:  # noqa: F811
    pipeline = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("text-only.yaml"))
    http, client = _gateway(pipeline, tokenizer)
    r = await http.post("/v1/audio/speech", json=_speech(pipeline))
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("model", "speech_unsupported")
    assert client.published == []


def test_the_talker_gets_the_chunks_in_order_with_their_token_positions() -> None:
    chunks = [
        SpeechChunk(text=t, token_ids=ids) for t, ids in (("a.", [5, 6]), ("b", [7]), ("c d", [8, 9, 10]))
    ]
    adm = Admission(
        request_id="r",
        gateway_id="g",
        arrival_ns=1,
        deadline_ns=2,
        entry_stage=1,
        text_chunks=chunks,
        audio=True,
    )
    tasks = entry_tasks(adm, [-1, 1, 0])
    assert [(t.kind, t.seq, t.final, t.text, t.token_ids, t.offset) for t in tasks] == [
        (TaskKind.CHUNK, 0, False, "a.", [5, 6], 0),
        (TaskKind.CHUNK, 1, False, "b", [7], 2),
        (TaskKind.CHUNK, 2, True, "c d", [8, 9, 10], 3),
    ]
    assert all(t.route == [-1, 1, 0] and t.attempt == 1 for t in tasks)
    (start,) = entry_tasks(adm.replace(entry_stage=0, text_chunks=[], prompt_token_ids=[1, 2]), [0, 1, 0])
    assert (start.kind, start.seq, start.final, start.prompt_token_ids) == (TaskKind.START, 0, True, [1, 2])


@pytest.mark.parametrize(("yaml_voice", "default"), [(None, "tara"), ("mia", "mia")])
async def test_the_voices_are_the_talkers_with_its_default(tokenizer, yaml_voice, default) -> None:  # noqa: F811
    http, _ = _gateway(_orpheus(yaml_voice), tokenizer)
    body = (await http.get("/v1/audio/voices")).json()
    assert [v["id"] for v in body["data"]] == list(ORPHEUS_VOICES)
    assert [v["id"] for v in body["data"] if v["default"]] == [default]
    assert "alloy" in body["openai_names"] and "tara" not in body["openai_names"]


async def test_a_talker_with_one_sound_lists_no_voices(tokenizer) -> None:  # noqa: F811
    http, _ = _gateway(load_pipeline(), tokenizer)
    assert (await http.get("/v1/audio/voices")).json() == {"object": "list", "data": [], "openai_names": []}
