"""Schema fuzzing of the gateway's HTTP API (issue 22 item 7; docs/testing.md, "Fuzzing").

Schemathesis generates requests from the gateway's own OpenAPI schema (``/openapi.json`` of a
gateway started here with ``OMNIRELAY_GATEWAY_DOCS=1``), schema-valid ones and schema-violating
ones, a bounded number per operation with a fixed seed, and sends them to that real gateway in
front of the session's pipeline (real engines), with its API key. Judged on every response: no
5xx, none slower than ``REQUEST_BOUND_S`` (no hang), every 4xx in OpenAI's error shape, every
200 well formed (JSON, or SSE whose every event is JSON and none an error); afterwards no request
handle is left behind: every gateway's and worker's registry load (the requests it holds, written
on each heartbeat) goes back to none and every request record of the run ends, within
``SETTLE_S``."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from schemathesis import GenerationMode

from libs.common.pipeline import DEFAULT_PIPELINE_PATH
from libs.stack.bus_state import snapshot
from libs.stack.local_nats import free_port
from tests.procs import ServiceProcess, start_service, stop_process

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("OMNIRELAY_FUZZ_SEED", "20261126"))
"""Hypothesis's seed: the same requests on every run (set ``OMNIRELAY_FUZZ_SEED`` to explore)."""
EXAMPLES = int(os.environ.get("OMNIRELAY_FUZZ_EXAMPLES", "25"))
"""Requests generated per operation and generation mode (positive, negative)."""
MAX_TOKENS = 8
"""The fuzzed gateway's ``OMNIRELAY_MAX_TOKENS_LIMIT``, and the largest ``max_tokens`` the schema
copy generates: a request that runs gets a few tokens, so the whole run stays short."""
MAX_SPEECH_CHARS = 40
"""Longest speech ``input`` the schema copy generates (the gateway takes 4,096)."""
REQUEST_BOUND_S = 45.0
"""A response (its last byte) later than this after its request counts as a hang, seconds."""
SETTLE_S = 30.0
"""How long the gateway's and workers' in-flight counts may take to come back, seconds."""
START_S = 120.0
FAILURES_SHOWN = 8


@dataclass
class FuzzGateway:
    url: str
    key: str
    proc: ServiceProcess


@pytest.fixture(scope="module")
def fuzz_gateway(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzGateway]:
    """A gateway of the session's pipeline with an API key, its schema served, ``max_tokens``
    capped at :data:`MAX_TOKENS`."""
    tmp = tmp_path_factory.mktemp("fuzz-gateway")
    key = "omr-fuzz-" + secrets.token_urlsafe(24)
    port = free_port()
    env = {
        "OMNIRELAY_API_KEYS": key,
        "OMNIRELAY_GATEWAY_DOCS": "1",
        "OMNIRELAY_MAX_TOKENS_LIMIT": str(MAX_TOKENS),
    }
    proc = start_service(
        ["gateway", "--port", str(port)], stack.nats_url, DEFAULT_PIPELINE_PATH, tmp / "gw.log", env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        seen = "no answer"
        while True:
            assert proc.proc.poll() is None, f"the gateway exited:\n{proc.text()[-3000:]}"
            assert time.monotonic() < deadline, f"not healthy in {START_S} s ({seen}):\n{proc.text()[-3000:]}"
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                if r.status_code == 200:
                    break
                seen = f"{r.status_code} {r.text[:500]}"
            except httpx.TransportError as e:
                seen = repr(e)
            time.sleep(0.2)
        yield FuzzGateway(url, key, proc)
    finally:
        stop_process(proc.proc, signal.SIGTERM, 30)


def bounded_schema(raw: dict[str, Any], model: str) -> dict[str, Any]:
    """The gateway's schema with generation steered to requests the pipeline runs: ``model`` only
    the served one; ``max_tokens``/``max_completion_tokens`` 1 to :data:`MAX_TOKENS`; ``n`` 1;
    at most 4 ``stop`` entries; text content parts (every role the schema has stays: the
    thinker's template refuses ``tool``, a 400 that was a 500 before the fuzzer found it); ``modalities`` items ``text``/``audio``; one completion prompt, no ``echo``;
    speech ``input`` at most :data:`MAX_SPEECH_CHARS`; no unknown fields (the gateway ignores
    them). Each of these the gateway answers with a 400 otherwise (``tests/e2e/test_bad_input.py``
    checks them one by one); without them most valid requests of the schema would stop there.
    Negative generation violates these bounds too, and the gateway must refuse that with a 4xx
    like any other violation."""
    schema = copy.deepcopy(raw)
    comps = schema["components"]["schemas"]
    tokens = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}, {"type": "null"}]}
    for name in ("ChatCompletionRequest", "CompletionRequest", "SpeechRequest"):
        comps[name]["additionalProperties"] = False
        props = comps[name]["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        for field_name in ("max_tokens", "max_completion_tokens"):
            if field_name in props:
                props[field_name] = tokens
        if "n" in props:
            props["n"] = {"type": "integer", "enum": [1]}
        if "stop" in props:
            props["stop"] = {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
            }
    chat = comps["ChatCompletionRequest"]["properties"]
    chat["modalities"] = {
        "anyOf": [{"type": "array", "items": {"type": "string", "enum": ["text", "audio"]}}, {"type": "null"}]
    }
    comps["ContentPart"]["properties"]["type"] = {"type": "string", "enum": ["text"]}
    comps["ContentPart"]["required"] = ["type", "text"]
    comps["ContentPart"]["properties"]["text"] = {"type": "string"}
    completion = comps["CompletionRequest"]["properties"]
    completion["prompt"] = {"type": "string"}
    completion["echo"] = {"type": "boolean", "enum": [False]}
    comps["SpeechRequest"]["properties"]["input"]["maxLength"] = MAX_SPEECH_CHARS
    return schema


@dataclass
class Verdicts:
    """What the fuzzing saw: every request's status, and what was wrong with any response."""

    statuses: dict[str, dict[int, int]] = field(default_factory=dict)
    """Operation → status → responses."""
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0

    def count(self, label: str, status: int) -> None:
        by = self.statuses.setdefault(label, {})
        by[status] = by.get(status, 0) + 1


def _error_shape(body: bytes) -> str | None:
    """Why ``body`` is not OpenAI's error shape (``{"error": {"message", "type", "param",
    "code"}}``, message and type non-empty strings, param and code strings or null), or None."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(err, dict):
        return f"not {{'error': {{...}}}}: {body[:300]!r}"
    if set(err) != {"message", "type", "param", "code"}:
        return f"error fields {sorted(err)}"
    if not (
        isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and err["type"]
    ):
        return f"message/type not non-empty strings: {err}"
    if not all(v is None or isinstance(v, str) for v in (err["param"], err["code"])):
        return f"param/code not strings or null: {err}"
    return None


def _content_type(headers: dict[str, Any]) -> str:
    """The Content-Type of a Schemathesis response (its headers map names to lists of values)."""
    for name, value in headers.items():
        if name.lower() == "content-type":
            return value[0] if isinstance(value, list) else str(value)
    return ""


def _ok_shape(content_type: str, body: bytes) -> str | None:
    """Why a 200's ``body`` is not well formed (JSON; SSE whose every ``data:`` is JSON or
    ``[DONE]`` and none an error; audio not empty), or None."""
    if content_type.startswith("application/json"):
        try:
            json.loads(body)
        except ValueError:
            return f"a 200 whose JSON does not parse: {body[:200]!r}"
        return None
    if content_type.startswith("text/event-stream"):
        datas = [ln[6:] for ln in body.decode("utf-8", "replace").splitlines() if ln.startswith("data: ")]
        if not datas:
            return "a 200 event stream with no events"
        for d in datas:
            if d == "[DONE]":
                continue
            try:
                event = json.loads(d)
            except ValueError:
                return f"an SSE event that is not JSON: {d[:200]!r}"
            if isinstance(event, dict) and "error" in event:
                return f"a 200 stream that ended in an error: {d[:300]}"
        return None
    if content_type.startswith("audio/"):
        return None if body else "a 200 audio response with no bytes"
    return f"a 200 of unexpected type {content_type!r}"


def fuzz_operation(op: Any, mode: GenerationMode, gw: FuzzGateway, verdicts: Verdicts) -> None:
    """Send :data:`EXAMPLES` requests of ``op`` generated in ``mode`` (seed :data:`SEED`), judge
    each response into ``verdicts``. Nothing is raised per example: no shrinking (its extra
    requests cost time), every failure is kept with the request that caused it."""
    strategy = op.as_strategy(generation_mode=mode)
    headers = {"Authorization": f"Bearer {gw.key}"}

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        t0 = time.monotonic()
        try:
            r = case.call(base_url=gw.url, headers=headers, timeout=REQUEST_BOUND_S)
        except Exception as e:  # a read timeout (a hang) or a dropped connection
            verdicts.failures.append(
                f"{op.label} [{mode.value}]: {type(e).__name__}: {e}; body {case.body!r}"
            )
            return
        took = time.monotonic() - t0
        verdicts.slowest_s = max(verdicts.slowest_s, took)
        verdicts.count(op.label, r.status_code)
        why = None
        if r.status_code >= 500:
            why = f"status {r.status_code}: {r.content[:300]!r}"
        elif took > REQUEST_BOUND_S:
            why = f"answered after {took:.1f} s"
        elif 400 <= r.status_code < 500:
            why = _error_shape(r.content)
        elif r.status_code == 200:
            why = _ok_shape(_content_type(r.headers), r.content)
        if why:
            verdicts.failures.append(f"{op.label} [{mode.value}]: {why}; body {case.body!r}")

    run()


def _held(nats_url: str, pipeline: Any) -> tuple[dict[str, int], set[str]]:
    """Every service's registry load (requests it holds), and the requests whose record is not
    terminal."""
    snap = asyncio.run(snapshot(nats_url, pipeline))
    loads = {s["key"]: s["load"] for s in snap["services"] if s["service"] in ("worker", "gateway")}
    return loads, {r["request_id"] for r in snap["inflight"]}


def test_schema_fuzzing_finds_no_5xx_no_hang_no_bad_shape_no_leak(fuzz_gateway, stack, pipeline) -> None:
    raw = httpx.get(f"{fuzz_gateway.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(bounded_schema(raw, pipeline.served_model_name))
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in ops} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/audio/speech",
        "GET /v1/models",
    }, [op.label for op in ops]
    _, open_before = _held(stack.nats_url, pipeline)
    t0 = time.monotonic()
    verdicts = Verdicts()
    for op in ops:
        modes = [GenerationMode.POSITIVE]
        if op.body or op.query or op.path_parameters or op.headers:
            modes.append(GenerationMode.NEGATIVE)  # an operation with no input has nothing to violate
        for mode in modes:
            fuzz_operation(op, mode, fuzz_gateway, verdicts)
    took = time.monotonic() - t0
    sent = sum(sum(by.values()) for by in verdicts.statuses.values())
    summary = (
        f"seed {SEED}, {EXAMPLES} examples per operation and mode: {sent} requests in {took:.1f} s, "
        f"slowest {verdicts.slowest_s:.1f} s; statuses {verdicts.statuses}"
    )
    print(summary)
    assert not verdicts.failures, f"{len(verdicts.failures)} bad responses ({summary}):\n" + "\n".join(
        verdicts.failures[:FAILURES_SHOWN]
    )
    # The run reached the pipeline: requests that ran (200) and requests refused (4xx) on the
    # operations that take a body.
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/audio/speech"):
        statuses = verdicts.statuses.get(label, {})
        assert statuses.get(200) and any(400 <= s < 500 for s in statuses), (label, summary)
    # Nothing is left behind: every gateway's request handles and every worker's requests (their
    # registry loads, written on each heartbeat) go back to none, every record of the run ends.
    deadline = time.monotonic() + SETTLE_S
    while True:
        loads, open_now = _held(stack.nats_url, pipeline)
        if loads and not any(loads.values()) and open_now <= open_before:
            break
        assert time.monotonic() < deadline, (
            f"registry loads {loads}, records not ended {open_now - open_before} after the fuzzing ({summary})"
        )
        time.sleep(0.5)
    assert httpx.get(f"{fuzz_gateway.url}/health", timeout=10).status_code == 200
