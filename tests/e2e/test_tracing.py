"""One trace per request across every service (spans collected by an OTLP receiver)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from libs.stack.bus_state import request_record, snapshot
from libs.stack.processes import wait_for

pytestmark = pytest.mark.e2e

SERVER, CONSUMER = 2, 5  # OTLP SpanKind values


def _wait_spans(otlp, trace_id: str, complete: Callable[[list], bool], timeout_s: float = 15.0) -> list:
    """The trace's spans once ``complete`` says every span the test checks has arrived (the
    services export in batches, each on its own schedule)."""

    def spans() -> list | None:
        got = otlp.trace(trace_id)
        return got if complete(got) else None

    try:
        return wait_for(spans, f"trace {trace_id} complete", timeout_s, every_s=0.2)
    except RuntimeError as e:
        got = sorted({(s.service, s.name) for s in otlp.trace(trace_id)})
        raise AssertionError(f"{e}; got {got}") from None


def _journeys_below(spans: list) -> set[str]:
    """The names of the stage spans that have an engine's ``llm_core`` journey span below them."""
    stage_spans = {s.span_id: s.name for s in spans if s.name.startswith("omni.stage ")}
    return {
        stage_spans[s.parent_span_id]
        for s in spans
        if s.name == "llm_core" and s.parent_span_id in stage_spans
    }


def test_one_trace_follows_an_audio_request_through_every_service(stack, pipeline, otlp) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "trace me"}],
        max_tokens=20,
        modalities=["text", "audio"],
        extra_body={"ignore_eos": True},
    )
    rec = asyncio.run(request_record(stack.nats_url, r.id))
    trace_id = rec["trace_id"]
    assert trace_id and len(trace_id) == 32
    # gateway, orchestrator admission, one span per stage (engines add theirs below the stages)
    wanted = {
        f"chat {pipeline.served_model_name}",
        "omni.admit",
        *(f"omni.stage {st.name}" for st in pipeline.stages[pipeline.thinker_stage :]),
    }
    engine_stages = {"omni.stage thinker", "omni.stage talker"}
    spans = _wait_spans(
        otlp,
        trace_id,
        lambda spans: wanted <= {s.name for s in spans} and _journeys_below(spans) == engine_stages,
    )
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if not s.parent_span_id]
    assert len(roots) == 1, [(s.service, s.name) for s in roots]
    root = roots[0]
    assert (root.service, root.kind) == ("omnirelay-gateway", SERVER)
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == pipeline.served_model_name
    assert root.attributes["gen_ai.usage.output_tokens"] == r.usage.completion_tokens == 20
    assert root.attributes["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert all(s.parent_span_id in by_id for s in spans if s is not root), "a span's parent is missing"

    (admit,) = [s for s in spans if s.name == "omni.admit"]
    assert (admit.service, admit.parent_span_id, admit.kind) == (
        "omnirelay-orchestrator",
        root.span_id,
        CONSUMER,
    )
    parent = admit
    assert not [s for s in spans if s.attributes.get("omnirelay.stage") == pipeline.listener_stage], (
        "the listener the chat skipped has a span"
    )
    for i, stage in enumerate(pipeline.stages):
        if i < pipeline.thinker_stage:
            continue
        (span,) = [s for s in spans if s.attributes.get("omnirelay.stage") == i]
        assert span.service == "omnirelay-worker" and span.name == f"omni.stage {stage.name}"
        assert span.parent_span_id == parent.span_id, f"{stage.name} is not a child of the previous hop"
        assert span.attributes["omnirelay.replica"] == rec["route"][i]
        received = [attrs for name, attrs in span.events if name == "chunk.received"]
        assert received and all(
            "omni.transfer.in_flight_s" in a and a["omni.transfer.tx_s"] >= 0 for a in received
        )
        if i + 1 < len(pipeline.stages):
            assert any(name == "chunk.sent" for name, _ in span.events)
        parent = span
    thinker = next(s for s in spans if s.attributes.get("omnirelay.stage") == pipeline.thinker_stage)
    assert thinker.attributes["gen_ai.usage.output_tokens"] == 20
    # inside the llm engines, each request's journey span hangs below its stage span
    stage_spans = {s.span_id for s in spans if s.name.startswith("omni.stage ")}
    assert all(j.parent_span_id in stage_spans for j in spans if j.name == "llm_core")


def test_one_trace_follows_a_speech_request_from_the_talker_on(stack, pipeline, otlp) -> None:
    """A ``/v1/audio/speech`` request enters at the talker: its trace is the gateway's root, the
    admission and one span per stage it ran, with no span of the thinker it skipped."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model=pipeline.served_model_name, voice="alloy", input="Trace this speech.", response_format="wav"
    ) as response:
        request_id = response.headers["x-request-id"]
        assert len(response.read()) > 44
    rec = asyncio.run(request_record(stack.nats_url, request_id))
    trace_id = rec["trace_id"]
    entry = pipeline.speech_stage
    assert trace_id and len(trace_id) == 32 and rec["entry_stage"] == entry
    spoken = pipeline.stages[entry:]
    wanted = {
        f"speech {pipeline.served_model_name}",
        "omni.admit",
        *(f"omni.stage {st.name}" for st in spoken),
    }
    spans = _wait_spans(
        otlp,
        trace_id,
        lambda spans: wanted <= {s.name for s in spans} and _journeys_below(spans) == {"omni.stage talker"},
    )
    roots = [s for s in spans if not s.parent_span_id]
    assert len(roots) == 1, [(s.service, s.name) for s in roots]
    root = roots[0]
    assert (root.service, root.kind, root.name) == (
        "omnirelay-gateway",
        SERVER,
        f"speech {pipeline.served_model_name}",
    )
    assert root.attributes["gen_ai.operation.name"] == "speech"
    assert root.attributes["omnirelay.request_id"] == request_id
    assert root.attributes["omnirelay.speech.format"] == "wav"
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_span_id in by_id for s in spans if s is not root), "a span's parent is missing"
    (admit,) = [s for s in spans if s.name == "omni.admit"]
    assert admit.parent_span_id == root.span_id
    assert not [s for s in spans if s.attributes.get("omnirelay.stage", entry) < entry], (
        "a skipped stage (the listener, the thinker) has a span"
    )
    parent = admit
    for i, stage in enumerate(spoken, start=entry):
        (span,) = [s for s in spans if s.attributes.get("omnirelay.stage") == i]
        assert span.name == f"omni.stage {stage.name}" and span.parent_span_id == parent.span_id, stage.name
        parent = span


def test_inspect_shows_the_trace_id_of_a_request(stack, pipeline) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=pipeline.served_model_name, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    out = subprocess.run(
        [sys.executable, "-m", "cli", "inspect", r.id, "--nats-url", stack.nats_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rec = asyncio.run(request_record(stack.nats_url, r.id))
    assert rec["trace_id"] and f'"trace_id": "{rec["trace_id"]}"' in out


def _exemplar_trace_ids(url: str, family: str) -> set[str]:
    """Trace ids of the exemplars on ``family``'s buckets, scraped as OpenMetrics."""
    text = httpx.get(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10).text
    return {
        s.exemplar.labels["trace_id"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == f"{family}_bucket" and s.exemplar is not None
    }


def test_latency_histograms_carry_the_trace_id_as_exemplar(stack, pipeline) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "exemplar"}],
        max_tokens=6,
        modalities=["text", "audio"],
    )
    trace_id = asyncio.run(request_record(stack.nats_url, r.id))["trace_id"]
    gateway = f"{stack.admin_url}/metrics"
    assert trace_id in _exemplar_trace_ids(gateway, "vllm:omni_e2e_request_latency_s")
    assert trace_id in _exemplar_trace_ids(gateway, "vllm:omni_audio_ttfp_s")
    snap = asyncio.run(snapshot(stack.nats_url, pipeline))
    talker = next(
        s["metrics_url"]
        for s in snap["services"]
        if s["service"] == "worker" and s["stage"] == pipeline.speech_stage
    )
    assert trace_id in _exemplar_trace_ids(talker, "vllm:omni_transfer_in_flight_s")
    # the classic text format carries no exemplars (Prometheus asks for OpenMetrics to get them)
    assert "trace_id" not in httpx.get(gateway, timeout=10).text
