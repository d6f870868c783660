"""The gateway resolves a chat request's ``audio.voice`` at admission, through its real route and
error handlers: an unknown voice is a 400 in OpenAI's shape and nothing is submitted; a known one
travels in the admission envelope as the talker will speak it.

The pipeline client is a stand-in that records what would have been published (and then refuses
it, so no response has to be streamed); everything before it is the gateway's own code."""

from __future__ import annotations

import httpx
import msgpack
import msgspec
import pytest
from fastapi import FastAPI

from libs.common.envelopes import Admission, decode
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, Payload, PipelineConfig, load_pipeline
from libs.common.records import RequestRecord, RequestStatus
from libs.models.tiny import resolve_model
from services.gateway.errors import install_error_handlers
from services.gateway.limits import ConcurrencyLimit
from services.gateway.prompting import Tokenizer
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.routes import router
from services.gateway.submission import Submitter
from tests.gateway_stubs import REFUSED, RecordingClient

ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(load_pipeline().thinker.model))


def _gateway(pipeline: PipelineConfig, tokenizer: Tokenizer) -> tuple[httpx.AsyncClient, RecordingClient]:
    app = FastAPI()
    app.include_router(router)
    install_error_handlers(app)
    client = RecordingClient()
    stat_log = GatewayStatLogger(MetricSet(Exporter.GATEWAY, False), pipeline.served_model_name)
    app.state.pipeline = pipeline
    app.state.api_keys = None  # no keys: served as a loopback gateway without any is
    app.state.concurrency = ConcurrencyLimit(0)
    app.state.submitter = Submitter(pipeline, client, tokenizer, stat_log)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return http, client


def _body(pipeline: PipelineConfig, audio: dict) -> dict:
    return {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
        "audio": audio,
        "stream": True,
    }


def _orpheus(voice: str | None = None) -> PipelineConfig:
    """orpheus-tiny.yaml, its talker's default voice set to ``voice`` when given."""
    p = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("orpheus-tiny.yaml"))
    if voice is None:
        return p
    stages = [
        s.model_copy(update={"talker": s.talker.model_copy(update={"voice": voice})})
        if s.emits == Payload.CODEC_CODES
        else s
        for s in p.stages
    ]
    return p.model_copy(update={"stages": stages})


@pytest.mark.parametrize("voice", ["Leo", "nobody", "", {"id": "voice_1234"}])
async def test_an_unknown_voice_is_a_400_and_nothing_is_published(tokenizer, voice) -> None:
    pipeline = _orpheus()
    http, client = _gateway(pipeline, tokenizer)
    r = await http.post("/v1/chat/completions", json=_body(pipeline, {"voice": voice, "format": "pcm16"}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "audio.voice",
        "invalid_value",
    )
    asked = voice["id"] if isinstance(voice, dict) else voice
    assert repr(asked) in err["message"] and all(v in err["message"] for v in ORPHEUS_VOICES)
    assert client.published == []


@pytest.mark.parametrize(
    ("yaml_voice", "asked", "spoken"),
    [
        (None, {"voice": "leo"}, "leo"),
        (None, {"voice": {"id": "zoe"}}, "zoe"),
        (None, {"voice": "alloy"}, "tara"),
        (None, {}, "tara"),
        ("mia", {"voice": "cedar"}, "mia"),
        ("mia", {"voice": "dan"}, "dan"),
    ],
)
async def test_a_known_voice_travels_in_the_admission(tokenizer, yaml_voice, asked, spoken) -> None:
    pipeline = _orpheus(yaml_voice)
    http, client = _gateway(pipeline, tokenizer)
    r = await http.post("/v1/chat/completions", json=_body(pipeline, {**asked, "format": "pcm16"}))
    assert r.status_code == REFUSED, r.text
    ((adm),) = client.published
    assert adm.audio and adm.voice == spoken
    assert decode(Admission, adm.encode()).voice == spoken


async def test_the_tiny_talker_takes_any_voice_and_text_requests_carry_none(tokenizer) -> None:
    pipeline = load_pipeline()
    http, client = _gateway(pipeline, tokenizer)
    for audio in ({"voice": "nobody"}, {"voice": "alloy"}, {}):
        r = await http.post("/v1/chat/completions", json=_body(pipeline, {**audio, "format": "wav"}))
        assert r.status_code == REFUSED, r.text
    r = await http.post(
        "/v1/chat/completions",
        json={"model": pipeline.served_model_name, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == REFUSED, r.text
    assert [(a.audio, a.voice) for a in client.published] == [(True, None)] * 3 + [(False, None)]


def test_an_admission_and_a_record_without_a_voice_decode_with_none() -> None:
    """A message of a gateway, or a record of an orchestrator, from before the field: the talker's
    default."""
    adm = Admission(
        request_id="r",
        gateway_id="g",
        arrival_ns=1,
        deadline_ns=2,
        prompt_token_ids=[1],
        sampling={"max_tokens": 1},
        audio=True,
    )
    old = msgspec.to_builtins(adm)
    old.pop("voice", None)  # absent, as a sender from before the field sends it
    assert decode(Admission, msgpack.packb(old, use_bin_type=True)).voice is None
    record = RequestRecord(
        request_id="r",
        pipeline="p",
        gateway_id="g",
        status=RequestStatus.RUNNING,
        route=[0, 0, 0],
        arrival_ns=1,
        admitted_ns=1,
        deadline_ns=2,
        updated_ns=1,
        voice="leo",
    )
    old = record.model_dump(mode="json")
    old.pop("voice", None)  # absent, as a sender from before the field sends it
    assert RequestRecord.model_validate(old).voice is None
    assert RequestRecord.model_validate_json(record.model_dump_json()).voice == "leo"
