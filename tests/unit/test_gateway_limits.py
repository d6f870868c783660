"""Bounded input at the gateway, through its real application (``create_app``: middleware, routes,
error handlers, submission) with a stand-in pipeline client: every limit answers its exact status
in OpenAI's error shape with its ``param`` and ``code``, submits nothing and leaves no
concurrency slot taken; tokenization does not stall the event loop; a stage's failure reaches the
client as its code, not its exception text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI

from libs.common.envelopes import Admission, ClientEvent, ClientEventType, Usage
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import load_pipeline
from libs.common.settings import GatewaySettings
from libs.models.tiny import resolve_model
from libs.stack.local_nats import free_port
from libs.stack.processes import wait_for
from services.gateway.app import server_options
from services.gateway.errors import APIError, response_of
from services.gateway.limits import InputLimits
from services.gateway.pipeline_client import RequestHandle
from services.gateway.prompting import Tokenizer
from services.gateway.request_size import RequestSizeLimit
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.responses import error_of
from services.gateway.submission import Submitter
from tests.gateway_stubs import REFUSED, RecordingClient
from tests.gateway_stubs import served as uvicorn_serving
from tests.unit.test_gateway_auth import gateway_app

MODEL = load_pipeline().served_model_name
MAX_MODEL_LEN = load_pipeline().thinker.engine.max_model_len


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "OMNIRELAY_API_KEYS",
        "OMNIRELAY_API_KEYS_FILE",
        "OMNIRELAY_ALLOW_IGNORE_EOS",
        "OMNIRELAY_HOST",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(load_pipeline().thinker.model))


def http(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_error(r: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == {
        400: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, err["type"])


def nothing_left(app: FastAPI, client: RecordingClient) -> None:
    assert client.published == []
    assert not app.state.concurrency.running, app.state.concurrency.running


# --- body size ----------------------------------------------------------------------------------
async def test_a_body_over_the_limit_is_413_by_its_length(tokenizer) -> None:
    app, client = gateway_app(GatewaySettings(max_body_bytes=4096), tokenizer)
    async with http(app) as h:
        r = await h.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 5000}])
        )
        assert_error(r, 413, None, "request_too_large")
        assert (await h.post("/v1/chat/completions", json=chat())).status_code == REFUSED
    assert len(client.published) == 1


async def test_a_chunked_body_is_cut_off_while_it_is_read(tokenizer) -> None:
    limit, piece, pieces = 1 << 20, 64 << 10, 100
    app, client = gateway_app(GatewaySettings(max_body_bytes=limit), tokenizer)
    pulled = 0

    async def body() -> AsyncIterator[bytes]:  # no Content-Length: sent chunked
        nonlocal pulled
        for _ in range(pieces):
            pulled += 1
            yield b" " * piece

    async with http(app) as h:
        r = await h.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
    assert_error(r, 413, None, "request_too_large")
    assert pulled <= limit // piece + 2, f"read {pulled} of {pieces} pieces past a {limit}-byte limit"
    nothing_left(app, client)


@pytest.mark.parametrize(
    "headers", [{f"x-h{i}": "1" for i in range(30)}, {"x-pad": "a" * 2048}], ids=["count", "bytes"]
)
async def test_too_many_header_bytes_or_headers_are_431(tokenizer, headers) -> None:
    app, client = gateway_app(GatewaySettings(max_headers=20, max_header_bytes=2048), tokenizer)
    async with http(app) as h:
        r = await h.post("/v1/chat/completions", json=chat(), headers=headers)
    assert_error(r, 431, None, "request_headers_too_large")
    nothing_left(app, client)


# --- content caps -------------------------------------------------------------------------------
CAPS = GatewaySettings(max_messages=3, max_prompt_chars=100, max_stop=4, max_tokens_limit=50)


@pytest.mark.parametrize(
    ("route", "body", "param", "code"),
    [
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "a"}] * 4),
            "messages",
            "too_many_messages",
        ),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "a" * 101}]),
            "messages",
            "prompt_too_long",
        ),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a" * 60}] * 2}]),
            "messages",
            "prompt_too_long",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a" * 101}, "prompt", "prompt_too_long"),
        ("/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "stop", "too_many_stop_sequences"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "stop": list("abcde")},
            "stop",
            "too_many_stop_sequences",
        ),
        ("/v1/chat/completions", chat(max_tokens=51), "max_tokens", "max_tokens_too_large"),
        (
            "/v1/chat/completions",
            chat(max_completion_tokens=51),
            "max_completion_tokens",
            "max_tokens_too_large",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "max_tokens": 51},
            "max_tokens",
            "max_tokens_too_large",
        ),
        ("/v1/chat/completions", chat(seed=2**70), "seed", "invalid_request"),
        ("/v1/chat/completions", chat(seed=-(2**70)), "seed", "invalid_request"),
        ("/v1/chat/completions", chat(n=2**70), "n", "invalid_request"),
        ("/v1/chat/completions", chat(max_tokens=2**70), "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", chat(max_tokens=-(2**70)), "max_tokens", "invalid_request"),
        ("/v1/chat/completions", chat(temperature=math.nan), "temperature", "invalid_request"),
        ("/v1/chat/completions", chat(top_p=math.inf), "top_p", "invalid_request"),
        (
            "/v1/audio/speech",
            {"model": MODEL, "voice": "alloy", "input": "a" * 4097},
            "input",
            "invalid_request",
        ),
    ],
)
async def test_each_cap_is_a_400_naming_its_parameter(tokenizer, route, body, param, code) -> None:
    app, client = gateway_app(CAPS, tokenizer)
    async with http(app) as h:
        r = await h.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert_error(r, 400, param, code)
    nothing_left(app, client)


LONE = "\ud83c"
"""A lone surrogate: valid in JSON (as ``\\ud83c``), with no UTF-8 form."""


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": f"hi {LONE}"}]),
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", chat(stop=["ok", LONE]), "stop.1"),
        ("/v1/chat/completions", chat(modalities=["text", "audio"], audio={"voice": LONE}), "audio.voice"),
        ("/v1/completions", {"model": MODEL, "prompt": LONE}, "prompt"),
        ("/v1/audio/speech", {"model": MODEL, "voice": "alloy", "input": LONE}, "input"),
    ],
)
async def test_text_with_a_lone_surrogate_is_a_400_on_its_field(tokenizer, route, body, param) -> None:
    app, client = gateway_app(GatewaySettings(), tokenizer)
    async with http(app) as h:
        r = await h.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert_error(r, 400, param, "invalid_request")
    nothing_left(app, client)


def test_an_error_quoting_a_lone_surrogate_still_renders() -> None:
    r = response_of(APIError(404, f"the model 'm{LONE}' does not exist", "model_not_found", "model"))
    assert r.status_code == 404 and r.body.isascii()
    assert json.loads(r.body)["error"]["message"] == f"the model 'm{LONE}' does not exist"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (chat(), 50),  # the default is what the context leaves, at most the cap
        (chat(max_tokens=50), 50),
        (chat(max_completion_tokens=7), 7),
        (chat(stop=["a", "b", "c", "d"]), 50),
    ],
)
async def test_within_the_caps_the_request_is_submitted(tokenizer, body, expected) -> None:
    app, client = gateway_app(CAPS, tokenizer)
    async with http(app) as h:
        assert (await h.post("/v1/chat/completions", json=body)).status_code == REFUSED
    (adm,) = client.published
    assert adm.sampling.max_tokens == expected


async def test_without_a_cap_in_reach_the_default_is_the_context_left(tokenizer) -> None:
    app, client = gateway_app(GatewaySettings(max_tokens_limit=10 * MAX_MODEL_LEN), tokenizer)
    async with http(app) as h:
        await h.post("/v1/chat/completions", json=chat())
    (adm,) = client.published
    prompt = tokenizer.chat([{"role": "user", "content": "hi"}])
    assert adm.sampling.max_tokens == MAX_MODEL_LEN - len(prompt)


@pytest.mark.parametrize(
    ("settings", "allowed"),
    [
        (GatewaySettings(), True),  # loopback: the local stack's benchmarks use it
        (GatewaySettings(host="0.0.0.0", api_keys="k"), False),
        (GatewaySettings(host="0.0.0.0", api_keys="k", allow_ignore_eos=True), True),
        (GatewaySettings(allow_ignore_eos=False), False),
    ],
)
async def test_ignore_eos_only_where_allowed(tokenizer, settings, allowed) -> None:
    app, client = gateway_app(settings, tokenizer)
    async with http(app) as h:
        r = await h.post(
            "/v1/chat/completions", json=chat(ignore_eos=True), headers={"Authorization": "Bearer k"}
        )
    if allowed:
        assert r.status_code == REFUSED and client.published[0].sampling.ignore_eos
    else:
        assert_error(r, 400, "ignore_eos", "unsupported_parameter")
        nothing_left(app, client)


# --- concurrency --------------------------------------------------------------------------------
class HoldingClient(RecordingClient):
    """Keeps every submission waiting until ``release`` is set, then refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def submit(self, adm: Admission, trace_headers: dict[str, str]) -> None:
        self.published.append(adm)
        await self.release.wait()
        raise APIError(REFUSED, "held by the test", "bus_unavailable")


async def test_a_key_runs_at_most_its_limit_at_once(tokenizer) -> None:
    client = HoldingClient()
    app, _ = gateway_app(GatewaySettings(api_keys="a,b", max_concurrent_per_key=2), tokenizer, client)
    key = {"a": {"Authorization": "Bearer a"}, "b": {"Authorization": "Bearer b"}}
    async with http(app) as h:
        held = [
            asyncio.create_task(h.post("/v1/chat/completions", json=chat(), headers=key["a"]))
            for _ in range(2)
        ]
        while len(client.published) < 2:
            await asyncio.sleep(0.01)
        r = await h.post("/v1/chat/completions", json=chat(), headers=key["a"])
        assert_error(r, 429, None, "too_many_requests")
        assert int(r.headers["retry-after"]) >= 1
        other = asyncio.create_task(h.post("/v1/chat/completions", json=chat(), headers=key["b"]))
        while len(client.published) < 3:  # another key is not limited by the first one's requests
            await asyncio.sleep(0.01)
        client.release.set()
        assert [r.status_code for r in await asyncio.gather(*held, other)] == [REFUSED] * 3
        assert not app.state.concurrency.running
        assert (await h.post("/v1/chat/completions", json=chat(), headers=key["a"])).status_code == REFUSED


async def test_slots_come_back_after_errors(tokenizer) -> None:
    app, _ = gateway_app(GatewaySettings(max_concurrent_per_key=1), tokenizer)
    async with http(app) as h:
        for body in (chat(model="nope"), chat(n=2), {"model": MODEL}, chat(), chat()):
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code in (400, 404, REFUSED), r.text
    assert not app.state.concurrency.running


# --- tokenization off the event loop ------------------------------------------------------------
async def test_a_long_prompt_is_tokenized_without_stalling_the_loop(tokenizer, monkeypatch) -> None:
    """The prompt is tokenized on another thread while the event loop goes on: the loop ticks
    during the tokenization (on the loop it could not tick at all). Judged by what happened
    during the call, not by a time, so a loaded box cannot fail it."""
    text = ("The quick brown fox jumps over the lazy dog. " * 12_000)[:500_000]
    app, client = gateway_app(GatewaySettings(max_prompt_chars=500_000, max_body_bytes=1 << 20), tokenizer)
    calls: list[tuple[int, float, float]] = []
    """(thread, start, end) of each tokenization, ``time.perf_counter()``."""
    chat_template = tokenizer.chat

    def traced(messages):
        start = time.perf_counter()
        try:
            return chat_template(messages)
        finally:
            calls.append((threading.get_ident(), start, time.perf_counter()))

    monkeypatch.setattr(tokenizer, "chat", traced)
    ticks: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    ticker = asyncio.create_task(tick())
    async with http(app) as h:
        r = await h.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": text}]))
    done.set()
    await ticker
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # it was tokenized
    ((thread, start, end),) = calls
    assert thread != threading.get_ident(), "tokenized on the event loop's thread"
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 2, f"the loop ticked {len(during)} times during {end - start:.3f} s of tokenizing"
    nothing_left(app, client)


# --- the HTTP server ----------------------------------------------------------------------------
def _status_of(port: int, header_bytes: int, complete: bool = True) -> str:
    """The status line a raw request with one ``header_bytes`` header gets (with its head left
    unfinished unless ``complete``)."""
    head = f"GET /ok HTTP/1.1\r\nHost: gw\r\nX-Pad: {'a' * header_bytes}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall((head + "\r\n" if complete else head).encode())
        return s.recv(4096).split(b"\r\n", 1)[0].decode()


def test_the_server_bounds_the_request_head() -> None:
    settings = GatewaySettings(port=free_port(), max_header_bytes=16 << 10)
    app = FastAPI()
    app.get("/ok")(lambda: {"ok": True})
    app.add_middleware(RequestSizeLimit, max_body_bytes=1024, max_headers=100, max_header_bytes=16 << 10)
    with uvicorn_serving(app, **server_options(settings)):
        assert _status_of(settings.port, 8 << 10) == "HTTP/1.1 200 OK"
        assert _status_of(settings.port, 32 << 10) == "HTTP/1.1 431 Request Header Fields Too Large"
        assert _status_of(settings.port, 32 << 10, complete=False).startswith("HTTP/1.1 400")


def test_a_head_that_does_not_arrive_in_time_loses_its_connection(tokenizer) -> None:
    settings = GatewaySettings(port=free_port(), request_head_timeout_s=1.0)
    with served(settings, tokenizer, StreamingClient(events=0, done=True)):
        with socket.create_connection(("127.0.0.1", settings.port), timeout=30) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n")  # and the rest never
            t0 = time.monotonic()
            assert slow.recv(4096) == b"", "the server answered a head it has not had"
            waited = time.monotonic() - t0
        assert 0.5 < waited < 20, waited
        assert httpx.get(f"http://127.0.0.1:{settings.port}/health", timeout=10).status_code == 200


# --- what a client learns of a stage's failure --------------------------------------------------
def _failure(status: int, code: str, message: str) -> ClientEvent:
    return ClientEvent(
        request_id="chatcmpl-r1",
        type=ClientEventType.ERROR,
        status=status,
        code=code,
        message=message,
        stage=2,
    )


def test_a_stage_failure_reaches_the_client_as_its_code_and_the_operator_with_its_detail(caplog) -> None:
    detail = "stage 2 (code2wav) failed: index 4097 out of range in /opt/omnirelay/venv/lib/torch/nn/x.py"
    with caplog.at_level(logging.WARNING):
        e = error_of(_failure(500, "stage_error", detail))
    assert (e.status, e.code) == (500, "stage_error")
    assert "stage_error" in e.message and "chatcmpl-r1" in e.message
    assert "4097" not in e.message and "/opt" not in e.message and "code2wav" not in e.message
    assert detail in caplog.text and "chatcmpl-r1" in caplog.text


def test_the_control_planes_own_messages_pass_and_unknown_statuses_are_500() -> None:
    said = "the request did not finish before its deadline"
    assert error_of(_failure(504, "timeout", said)).message == said
    assert error_of(_failure(200, "timeout", said)).status == 500
    assert error_of(_failure(302, "stage_error", "x")).status == 500
    assert error_of(_failure(400, "invalid_input", "text chunk 3 cannot be spoken: ...")).status == 400


# --- a client that reads too slowly -------------------------------------------------------------
class StreamingClient(RecordingClient):
    """Answers each submission with a handle already holding ``events`` text deltas (and the
    end, when ``done``); records aborts."""

    def __init__(self, events: int, done: bool) -> None:
        super().__init__()
        self.events, self.done = events, done
        self.aborted: list[tuple[str, str]] = []

    async def submit(self, adm: Admission, trace_headers: dict[str, str]) -> RequestHandle:
        self.published.append(adm)
        handle = RequestHandle(adm.request_id, adm.deadline_ns)
        for _ in range(self.events):
            handle.put(ClientEvent(request_id=adm.request_id, type=ClientEventType.TEXT, text="x" * 2048))
        if self.done:
            usage = Usage(prompt_tokens=1, completion_tokens=self.events)
            handle.put(ClientEvent(request_id=adm.request_id, type=ClientEventType.TEXT_DONE, usage=usage))
        return handle

    def release(self, request_id: str) -> None:
        pass

    def abort(self, request_id: str, reason: str) -> None:
        self.aborted.append((request_id, reason))


class CountingStats(GatewayStatLogger):
    slow = 0

    def slow_reader(self) -> None:
        self.slow += 1


@contextlib.contextmanager
def served(
    settings: GatewaySettings, tokenizer: Tokenizer, client: StreamingClient
) -> Iterator[CountingStats]:
    """The gateway's application on a real uvicorn server (its own thread and loop), with
    ``client`` in place of the bus."""
    app, _ = gateway_app(settings, tokenizer, client)
    stats = CountingStats(MetricSet(Exporter.GATEWAY, False), MODEL)
    app.state.submitter = Submitter(load_pipeline(), client, tokenizer, stats, InputLimits.of(settings))
    with uvicorn_serving(app, **server_options(settings), lifespan="off"):
        yield stats


def _stream_request(port: int) -> socket.socket:
    """A streamed chat request sent on a raw socket (the server closes it after the response)."""
    body = json.dumps(chat(stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def _read_to_end(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = bytearray()
    while chunk := s.recv(1 << 16):
        out += chunk
    return bytes(out)


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    wait_for(condition, what, timeout_s, every_s=0.02)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (dict(max_buffered_events=0, slow_reader_timeout_s=1.0), "not taken within"),
        (dict(max_buffered_events=64, slow_reader_timeout_s=60.0), "events waiting"),
    ],
    ids=["write-timeout", "backlog"],
)
def test_a_client_that_does_not_read_is_aborted_and_cut_off(tokenizer, caplog, settings, why) -> None:
    client = StreamingClient(events=20_000, done=True)  # ~40 MB of deltas
    gw = GatewaySettings(port=free_port(), **settings)
    with caplog.at_level(logging.WARNING), served(gw, tokenizer, client) as stats:
        s = _stream_request(gw.port)  # and nothing read: the socket's buffers fill, the writes wait
        # the abort (as the stream's generator closes) comes a moment before the count
        _wait(lambda: client.aborted and stats.slow, "the slow reader aborted and counted")
        (adm,) = client.published
        assert client.aborted == [(adm.request_id, "client disconnected")]
        assert stats.slow == 1
        got = _read_to_end(s)  # the server closed the connection: the stream has no end
        s.close()
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
    assert got.count(b"data: ") < 20_000
    assert why in caplog.text and adm.request_id in caplog.text


@pytest.mark.parametrize("times", [1, 3], ids=["under-the-bound", "burst-over-the-bound"])
def test_a_client_that_keeps_up_gets_the_whole_stream(tokenizer, times: int) -> None:
    """All the events wait at once, as a burst from the bus: under the bound, and 3 × over it (the
    backlog after the gateway's own pause, which a reading client takes in milliseconds; before
    ``BACKLOG_GRACE_S`` such a stream was aborted as a slow reader)."""
    events = times * GatewaySettings().max_buffered_events - 1
    client = StreamingClient(events=events, done=True)
    gw = GatewaySettings(port=free_port())
    with served(gw, tokenizer, client) as stats:
        s = _stream_request(gw.port)
        got = _read_to_end(s)
        s.close()
    assert b"data: [DONE]" in got
    assert stats.slow == 0 and client.aborted == []
    assert got.count(b'"content":"' + b"x" * 2048) == events
