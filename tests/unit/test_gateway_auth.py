"""API keys at the gateway, through its real application (``create_app``) and error handlers:
every ``/v1/*`` route answers 401 in OpenAI's shape without a valid bearer key and submits
nothing; ``/health`` stays open; the official ``openai`` client's ``api_key`` is what the gateway
checks; the start-up rule for a gateway without keys; ``/docs`` off by default.

The pipeline client is a stand-in that records what would have been published and then refuses
it (no response has to be streamed); everything in front of it is the gateway's own code."""

from __future__ import annotations

import hmac
import logging
import stat
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient, WebSocketDenialResponse
from typer.testing import CliRunner

from cli.main import app as cli_app
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import load_pipeline
from libs.common.settings import GatewaySettings
from libs.models.tiny import resolve_model
from services.gateway import auth
from services.gateway.app import create_app
from services.gateway.auth import ApiKeys, AuthConfigError, load_api_keys
from services.gateway.limits import InputLimits
from services.gateway.prompting import Tokenizer
from services.gateway.realtime.client_secrets import mint
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.submission import Submitter
from tests.gateway_stubs import REFUSED, RecordingClient

KEY_A, KEY_B = "sk-first-0123456789", "sk-second-abcdefghij"


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OMNIRELAY_API_KEYS", "OMNIRELAY_API_KEYS_FILE", "OMNIRELAY_ALLOW_NO_AUTH", "OMNIRELAY_HOST"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(load_pipeline().thinker.model))


def gateway_app(
    settings: GatewaySettings, tokenizer: Tokenizer, client: RecordingClient | None = None
) -> tuple[FastAPI, RecordingClient]:
    """``create_app`` with a stand-in client (``client``, else a :class:`RecordingClient`) in
    place of what its lifespan would start."""
    pipeline = load_pipeline()
    app = create_app(settings, pipeline)
    client = client or RecordingClient()
    stat_log = GatewayStatLogger(MetricSet(Exporter.GATEWAY, False), pipeline.served_model_name)
    app.state.client = client
    app.state.submitter = Submitter(pipeline, client, tokenizer, stat_log, InputLimits.of(settings))
    return app, client


def http(app: FastAPI, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=headers)


def v1_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every ``/v1/*`` route the application serves."""
    return sorted(
        (m, r.path) for r in app.routes if r.path.startswith("/v1/") for m in getattr(r, "methods", ())
    )


def bodies() -> dict[str, dict]:
    model = load_pipeline().served_model_name
    return {
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"model": model, "prompt": "hi"},
        "/v1/audio/speech": {"model": model, "input": "hi", "voice": "alloy"},
        "/v1/realtime/client_secrets": {},
    }


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


@pytest.mark.parametrize("presented", [None, "", "sk-wrong", KEY_A + "x", KEY_A[:-1]])
async def test_every_v1_route_needs_a_valid_key_and_submits_nothing(tokenizer, presented) -> None:
    app, client = gateway_app(GatewaySettings(api_keys=f"{KEY_A},{KEY_B}"), tokenizer)
    routes = v1_routes(app)
    assert {p for _, p in routes} == {
        "/v1/models",
        "/v1/audio/voices",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/chat/completions",
        "/v1/realtime/client_secrets",
        "/v1/completions",
    }
    async with http(app, presented) as h:
        for method, path in routes:
            assert_401(await h.request(method, path, json=bodies().get(path)))
        assert (await h.get("/health")).status_code == 200  # liveness probes need no key
    assert client.published == []


@pytest.mark.parametrize("key", [KEY_A, KEY_B])
async def test_any_configured_key_is_let_through(tokenizer, key) -> None:
    app, client = gateway_app(GatewaySettings(api_keys=f"{KEY_A},{KEY_B}"), tokenizer)
    async with http(app, key) as h:
        assert (await h.get("/v1/models")).json()["data"][0]["id"] == load_pipeline().served_model_name
        r = await h.post("/v1/chat/completions", json=bodies()["/v1/chat/completions"])
    assert r.status_code == REFUSED  # past the key check, handed to the (refusing) bus
    assert len(client.published) == 1


async def test_the_scheme_is_bearer_in_any_case_and_nothing_else(tokenizer) -> None:
    app, _ = gateway_app(GatewaySettings(api_keys=KEY_A), tokenizer)
    async with http(app) as h:
        for header, status in [
            (f"bearer {KEY_A}", 200),
            (f"BEARER {KEY_A}", 200),
            (f"Basic {KEY_A}", 401),
            (KEY_A, 401),
            ("Bearer", 401),
        ]:
            assert (await h.get("/v1/models", headers={"Authorization": header})).status_code == status, (
                header
            )


async def test_the_openai_client_sends_its_api_key_as_the_bearer_key(tokenizer) -> None:
    app, _ = gateway_app(GatewaySettings(api_keys=KEY_A), tokenizer)

    def client(key: str) -> openai.AsyncOpenAI:
        transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0, http_client=transport)

    with pytest.raises(openai.AuthenticationError) as e:
        await client("sk-wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    models = await client(KEY_A).models.list()
    assert [m.id for m in models.data] == [load_pipeline().served_model_name]


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys.of([KEY_A, KEY_B, "sk-third-zzzzzzzzzz"])
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented in (KEY_A, KEY_B, "nope"):
        calls.clear()
        keys.match(presented)
        assert len(calls) == 3, presented
    assert keys.match(KEY_A) != keys.match(KEY_B)
    assert KEY_A not in (keys.match(KEY_A) or "")


def test_a_keys_file_takes_one_key_per_line_with_comments(tmp_path: Path, tokenizer) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# operators\n{KEY_A}\n\n  {KEY_B}   # the batch jobs\n")
    keys = load_api_keys(GatewaySettings(api_keys_file=f, host="0.0.0.0"))
    assert keys is not None and keys.match(KEY_A) and keys.match(KEY_B)
    assert keys.match("# operators") is None and keys.match("the batch jobs") is None


@pytest.mark.parametrize("content", [None, "# nothing but a comment\n\n"])
def test_a_keys_file_missing_or_empty_refuses_to_start(tmp_path: Path, content: str | None) -> None:
    f = tmp_path / "keys"
    if content is not None:
        f.write_text(content)
    with pytest.raises(AuthConfigError, match=str(f)):
        load_api_keys(GatewaySettings(api_keys_file=f))


def test_a_key_is_generated_once_mode_0600_and_never_logged(tmp_path: Path, caplog) -> None:
    f = tmp_path / "data" / "api-key"
    settings = GatewaySettings(api_keys_file=f, generate_api_key=True, host="0.0.0.0")
    with caplog.at_level(logging.INFO):
        first = load_api_keys(settings)
    (key,) = auth.read_keys_file(f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert key.startswith("omr-") and len(key) >= 40
    assert first is not None and first.match(key)
    assert str(f) in caplog.text and key not in caplog.text
    assert load_api_keys(settings) == first  # the second start reads the same key
    assert auth.read_keys_file(f) == [key]


def test_no_key_is_generated_when_keys_are_given(tmp_path: Path) -> None:
    f = tmp_path / "api-key"
    keys = load_api_keys(GatewaySettings(api_keys=KEY_A, api_keys_file=f, generate_api_key=True))
    assert keys is not None and keys.match(KEY_A) and not f.exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_no_keys_on_loopback_serves_open_and_says_so(host: str, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_api_keys(GatewaySettings(host=host)) is None
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "WITHOUT authentication" in rec.getMessage() and host in rec.getMessage()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway"])
def test_no_keys_elsewhere_refuses_unless_explicitly_unsafe(host: str, caplog) -> None:
    with pytest.raises(AuthConfigError, match="OMNIRELAY_ALLOW_NO_AUTH"):
        load_api_keys(GatewaySettings(host=host))
    with caplog.at_level(logging.WARNING):
        assert load_api_keys(GatewaySettings(host=host, allow_no_auth=True)) is None
    assert "UNSAFE" in caplog.text


def test_the_gateway_command_refuses_a_public_bind_without_keys_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The command's process-wide set-up (scheduling policy, logging, tracing) is left out here:
    # it would stay with the test process.
    for target in (
        "cli.main.yield_on_wakeup",
        "cli.main.set_service_identity",
        "services.gateway.app.setup_tracing",
    ):
        monkeypatch.setattr(target, lambda *_: None)
    r = CliRunner().invoke(cli_app, ["gateway", "--host", "0.0.0.0", "--nats-url", "nats://127.0.0.1:1"])
    assert r.exit_code == 2, r.output
    (error,) = r.stderr.strip().splitlines()
    assert error.startswith("error: refusing to serve on 0.0.0.0 without API keys")


async def test_openapi_pages_are_off_unless_asked_for(tokenizer) -> None:
    off, _ = gateway_app(GatewaySettings(), tokenizer)
    on, _ = gateway_app(GatewaySettings(gateway_docs=True), tokenizer)
    async with http(off) as h:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await h.get(path)).status_code == 404, path
    async with http(on) as h:
        assert (await h.get("/openapi.json")).json()["paths"].keys() >= {"/v1/chat/completions"}
        assert (await h.get("/docs")).status_code == 200
    assert "/v1/audio/speech" in off.openapi()["paths"]  # the schema is still built in-process


@pytest.mark.parametrize("presented", [None, "sk-wrong"])
def test_a_realtime_upgrade_without_a_valid_key_is_a_401_and_no_socket(tokenizer, presented) -> None:
    app, _ = gateway_app(GatewaySettings(api_keys=KEY_A), tokenizer)
    headers = {"Authorization": f"Bearer {presented}"} if presented else {}
    with (
        pytest.raises(WebSocketDenialResponse) as e,
        TestClient(app).websocket_connect("/v1/realtime", headers=headers),
    ):
        pass
    assert e.value.status_code == 401
    assert e.value.json()["error"]["code"] == "invalid_api_key"


def test_a_client_secret_opens_sessions_as_its_key_until_it_expires(tokenizer) -> None:
    app, _ = gateway_app(GatewaySettings(api_keys=KEY_A), tokenizer)
    tc = TestClient(app)
    r = tc.post(
        "/v1/realtime/client_secrets",
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"expires_after": {"anchor": "created_at", "seconds": 60}},
    )
    assert r.status_code == 200, r.text
    secret = r.json()["value"]
    assert secret.startswith("ek_") and r.json()["session"]["type"] == "realtime"
    protocols = ["realtime", f"openai-insecure-api-key.{secret}"]
    with tc.websocket_connect("/v1/realtime", subprotocols=protocols) as ws:
        assert ws.receive_json()["type"] == "session.created"
    with tc.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {secret}"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    keys = app.state.api_keys
    expired, _ = mint(keys, keys.match(KEY_A), 10, now=0)
    forged = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    for bad in (expired, forged, "ek_" + secret[3:].replace(".", "")):
        with (
            pytest.raises(WebSocketDenialResponse) as e,
            tc.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {bad}"}),
        ):
            pass
        assert e.value.status_code == 401
    assert tc.post("/v1/realtime/client_secrets", json={}).status_code == 401, "minting needs a key"
