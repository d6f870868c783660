"""Messages the thinker's chat template refuses are the client's error (400 on ``messages``), not the
gateway's (a 500 ``internal_error`` before: found by the schema fuzzer, tests/e2e/test_fuzz_http.py,
with a ``tool`` message, which the schema allows and the tiny thinker's template does not take)."""

from __future__ import annotations

import httpx
import pytest

from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import load_pipeline
from libs.common.settings import GatewaySettings
from libs.models.tiny import resolve_model
from services.gateway.app import create_app
from services.gateway.errors import APIError
from services.gateway.limits import InputLimits
from services.gateway.prompting import Tokenizer
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.submission import Submitter
from tests.gateway_stubs import REFUSED, RecordingClient


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(load_pipeline().thinker.model))


def test_the_template_refusing_a_role_is_a_400_on_messages(tokenizer: Tokenizer) -> None:
    with pytest.raises(APIError) as e:
        tokenizer.chat([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "invalid_request")
    assert "tool" in e.value.message
    assert tokenizer.chat([{"role": "user", "content": "hi"}])  # a role it takes still renders


async def test_through_the_app_nothing_is_queued(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("OMNIRELAY_API_KEYS", "OMNIRELAY_API_KEYS_FILE", "OMNIRELAY_HOST"):
        monkeypatch.delenv(var, raising=False)
    pipeline, settings = load_pipeline(), GatewaySettings()
    app = create_app(settings, pipeline)
    client = RecordingClient()
    stats = GatewayStatLogger(MetricSet(Exporter.GATEWAY, False), pipeline.served_model_name)
    app.state.client = client
    app.state.submitter = Submitter(pipeline, client, tokenizer, stats, InputLimits.of(settings))
    body = {"model": pipeline.served_model_name, "messages": [{"role": "tool", "content": "42"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as h:
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"], err["code"]) == (
            "invalid_request_error",
            "messages",
            "invalid_request",
        )
        assert client.published == [] and not app.state.concurrency.running
        body["messages"] = [{"role": "user", "content": "hi"}]
        assert (await h.post("/v1/chat/completions", json=body)).status_code == REFUSED  # reaches the bus


@pytest.mark.parametrize("model", ["tiny-thinker", "tiny-orpheus"])
def test_the_gateways_tokenizer_gives_the_ids_autotokenizer_gives(model: str) -> None:
    """The gateway builds the generic fast tokenizer directly (no torch in the gateway); the ids
    of prompts, texts and chats are those of the tokenizer vLLM's own server loads
    (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    path = resolve_model(model)
    ours, auto = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours._tok) is type(auto)
    for text in ("Hello!", "  spaces and\ttabs\nnew lines ", "ünïcödé ✓ 中文", ""):
        assert ours.text(text) == auto.encode(text, add_special_tokens=True)
        assert ours.words(text) == auto.encode(text, add_special_tokens=False)
    if auto.chat_template:
        chat = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ]
        rendered = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.chat(chat) == auto.encode(rendered, add_special_tokens=False)
