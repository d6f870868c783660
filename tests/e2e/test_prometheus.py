"""A real Prometheus federates the stack through the gateway's HTTP service discovery.

Prometheus (Debian's binary, ``make prometheus-bin``) runs with compose/prometheus.yml, changed only
where the compose network differs: the service-discovery URL is the stack's
``/prometheus/targets``, intervals are 1 s, its own scrape address is its free port, and the
compose-only ``nats`` exporter job is dropped. The tests send known traffic with the official
``openai`` client and compare PromQL answers with ground truth measured independently (what the
client saw, the bytes a NATS subscriber of our own captured on the bus, the routes in the
``omni_requests`` KV records), check that every series carries the one label scheme (also on
``/federate``), run every dashboard query, and show a replica joining and leaving without any
configuration change.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from libs.common import headers as h
from libs.common.bus_state import request_record, snapshot
from libs.common.envelopes import ClientEvent, ClientEventType, NdArray, StageTask, TaskKind, decode
from libs.common.local_nats import free_port
from libs.common.metrics_catalog import ENGINE_PROCESSES
from libs.common.publish import Hop, publish_task
from libs.common.subjects import Subjects
from tests import needs
from tests.bus import await_replacement, dead_letter
from tests.procs import (
    CODE2WAV_YAML,
    TALKER_YAML,
    THINKER_YAML,
    ServiceProcess,
    kill_confirmed,
    stop_confirmed,
    stop_process,
    worker_pid,
    write_pipeline,
)
from tests.unit.test_dashboard import DASHBOARD, dashboard_queries, grafana_to_promql, metric_names

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "compose" / "prometheus.yml"
INTERVAL = "1s"
SR = 24_000
LATENCY_SLACK_S = 0.25
"""Per request: the client's clock (before sending → after reading the last byte, or the first
audio chunk) may exceed the gateway's arrival → last byte / first audio written by at most this,
on loopback, with the five requests running concurrently in one client event loop."""
WAIT_S = 20.0
"""How long a PromQL answer may take to reflect what happened (1 s scrapes; vLLM emits its
scheduler stats at most once a second and a final snapshot when it goes idle)."""
DYN_PIPELINE = "promdyn"
DEAD_PIPELINE = "promdead"
UNIFIED = ("service", "pipeline", "instance", "job")
WORKER_LABELS = ("stage", "replica", "stage_name")


def _series(family: str, kind: str) -> tuple[str, ...]:
    """The series names prometheus_client exposes for a family (``_created``: the text format)."""
    parts = ("_total", "_created") if kind == "counter" else ("_bucket", "_sum", "_count", "_created")
    return tuple(family + p for p in parts)


_STAGE_REPLICA = {"stage", "replica"}
OWN_STAGE_LABELS: dict[str, set[str]] = {
    name: labels
    for family, kind, labels in (
        # DESIGN.md §5: the gateway's audio families carry {model_name, stage, replica} of the stage
        # that produced the audio (the spec's, the arrival-anchored RTF, the stream denominator and
        # late-chunk counts beyond it).
        *(
            (f"vllm:omni_audio_{n}", "histogram", _STAGE_REPLICA)
            for n in ("ttfp_s", "duration_s", "rtf", "client_rtf", "underrun_s")
        ),
        *(
            (f"vllm:omni_audio_{n}", "counter", _STAGE_REPLICA)
            for n in ("frames", "continuity_ok", "skipped_requests", "streams", "late_chunks")
        ),
        # docs/reliability.md: the gateway drops a moved stage's stale events and counts event gaps
        # per stage; the orchestrator counts evictions per replica and moves per stage (their
        # replicas are from_replica / to_replica).
        ("vllm:omni_stale_events_dropped", "counter", {"stage"}),
        ("vllm:omni_client_event_gaps", "counter", {"stage"}),
        ("vllm:omni_replica_evictions", "counter", _STAGE_REPLICA),
        ("vllm:omni_requests_migrated", "counter", {"stage"}),
    )
    for name in _series(family, kind)
}
"""Series name → the ``stage``/``replica`` labels its own family has on a service whose target
carries none (the gateway, the orchestrator), written out from DESIGN.md and docs/reliability.md,
not read from the metric catalog: a gateway or orchestrator family that wrongly declares ``stage``
or ``replica`` shows as an unexpected label, one that lacks its own as a missing one."""


# --- a Prometheus process ----------------------------------------------------------------------------
class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path, sd_url: str) -> None:
        self.url, self.proc, self.log, self.sd_url = url, proc, log, sd_url
        self.http = httpx.Client(base_url=url, timeout=30)

    def api(self, path: str, **params: Any) -> Any:
        r = self.http.get(f"/api/v1/{path}", params=params)
        body = r.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, q: str, at: float | None = None) -> list[dict[str, Any]]:
        return self.api("query", query=q, **({"time": f"{at:.3f}"} if at is not None else {}))["result"]

    def vector(self, q: str, *labels: str, at: float | None = None) -> dict[tuple[str, ...], float]:
        return {
            tuple(r["metric"].get(n, "") for n in labels): float(r["value"][1]) for r in self.query(q, at)
        }

    def scalar(self, q: str, at: float | None = None) -> float | None:
        res = self.query(q, at)
        assert len(res) <= 1, res
        return float(res[0]["value"][1]) if res else None

    def grown(
        self, selector: str, by: str, t0: float, at: float | None = None
    ) -> dict[tuple[str, ...], float]:
        """Increase of ``sum by (by) (selector)`` since ``t0`` (raw values, no extrapolation; a series
        created after ``t0`` counts from 0)."""
        now = f"sum by ({by}) ({selector})"
        then = f"sum by ({by}) ({selector} @ {t0:.3f})"
        labels = [n.strip() for n in by.split(",") if n.strip()]
        return self.vector(f"({now} - {then}) or {now}", *labels, at=at)

    def wait_scraped_after(self, t: float, scrapes: int = 1, timeout_s: float = WAIT_S) -> None:
        """Wait until every service the stack's service discovery lists now has been scraped
        successfully (``up`` 1) ``scrapes`` times after wall time ``t`` (s): what those services
        exported at ``t`` is then in Prometheus, and ``rate()`` over a window holding those scrapes
        has the two samples it needs. A listed service Prometheus has no sample of yet counts as
        not scraped (it may have just come back: a worker stopped for longer than the registry's
        TTL leaves the listing and its series go stale until it is scraped again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            want = {g["labels"]["__meta_omnirelay_instance"] for g in self.sd()}
            window = max(2, int(time.time() - t) + 2)
            got = {
                r["metric"]["instance"]: sum(1 for ts, v in r["values"] if float(ts) > t and float(v) == 1)
                for r in self.query(f'up{{job="omnirelay"}}[{window}s]')
            }
            short = {i: got.get(i, 0) for i in want if got.get(i, 0) < scrapes}
            if want and not short:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not scraped successfully {scrapes} time(s) after {t:.3f} within {timeout_s} s: {short}"
                )
            time.sleep(0.2)

    def sd(self) -> list[dict[str, Any]]:
        """The stack's service-discovery answer (the targets Prometheus is told about)."""
        return httpx.get(self.sd_url, timeout=30).json()

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]


def eventually(fn, ok, timeout_s: float = WAIT_S, every_s: float = 0.25):
    """``fn()`` until ``ok(value)`` or the timeout; returns the last value (assert on it)."""
    deadline = time.monotonic() + timeout_s
    value = fn()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(every_s)
        value = fn()
    return value


def sd_groups(stack) -> list[dict[str, Any]]:
    return httpx.get(f"{stack.base_url}/prometheus/targets", timeout=30).json()


def local_config(sd_url: str, port: int) -> dict[str, Any]:
    """compose/prometheus.yml with the local differences (and nothing else) applied."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL, evaluation_interval=INTERVAL)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"omnirelay", "prometheus", "nats"}, set(jobs)
    (sd,) = jobs["omnirelay"]["http_sd_configs"]
    assert sd["url"] == "http://gateway:8000/prometheus/targets"
    sd.update(url=sd_url, refresh_interval=INTERVAL)
    jobs["prometheus"]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    config["scrape_configs"] = [jobs["omnirelay"], jobs["prometheus"]]  # no NATS exporter here
    return config


@pytest.fixture(scope="module")
def prom(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = needs.program(
        "prometheus", "Debian's prometheus is not installed: run `make prometheus-bin` (`make test` does)"
    )
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(local_config(f"{stack.base_url}/prometheus/targets", port), sort_keys=False)
    )
    log = tmp / "prometheus.log"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--enable-feature=exemplar-storage",
    ]
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    p = Prometheus(f"http://127.0.0.1:{port}", proc, log, f"{stack.base_url}/prometheus/targets")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{p.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        want = {g["labels"]["__meta_omnirelay_instance"] for g in sd_groups(stack)}
        up = eventually(
            lambda: p.vector('up{job="omnirelay"} == 1', "instance"), lambda v: want <= {k[0] for k in v}
        )
        assert want <= {k[0] for k in up}, (want, up, p.targets())
        print(
            f"\nprometheus ready {ready_s:.1f} s, all {len(want)} services up {time.monotonic() - t0:.1f} s after start"
        )
        yield p
    finally:
        p.http.close()
        stop_process(proc, signal.SIGTERM, 15)


# --- known traffic and its ground truth ---------------------------------------------------------------
@dataclass
class Traffic:
    t0: float
    """Wall time before the traffic, after every target was scraped in quiet."""
    finish: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    first_audio: list[float] = field(default_factory=list)
    frames: int = 0
    ids: list[str] = field(default_factory=list)
    audio_ids: list[str] = field(default_factory=list)
    bus_bytes: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    bus_hops: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    talker_requests: Counter[str] = field(default_factory=Counter)
    """Chunks with text tokens received per talker replica (each is one talker engine request)."""
    routes: dict[str, list[int]] = field(default_factory=dict)
    """Request id → the replica of each stage, as its ``omni_requests`` record says."""
    bus_routes: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    """Request id → stage → the replica its messages were addressed to on the bus."""
    trace_ids: dict[str, str] = field(default_factory=dict)
    """Request id → the trace id its client chose (sent as ``traceparent``)."""
    seconds: float = 0.0
    t1: float = 0.0
    """Wall time after the last response."""


TEXT_MAX_TOKENS = (3, 7, 5)
AUDIO_MAX_TOKENS = (24, 12)


def _traceparent() -> tuple[str, dict[str, str]]:
    """A trace id of the client's own and the W3C header that continues it (sampled)."""
    trace_id = uuid.uuid4().hex
    return trace_id, {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}


async def _text(client: openai.AsyncOpenAI, model: str, n: int, out: Traffic) -> None:
    trace_id, headers = _traceparent()
    t = time.monotonic()
    r = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=n,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    out.latencies.append(time.monotonic() - t)
    out.finish[r.choices[0].finish_reason] += 1
    out.ids.append(r.id)
    out.trace_ids[r.id] = trace_id


async def _audio_stream(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, headers: dict[str, str] | None = None
) -> openai.AsyncStream:
    """A streamed text + audio (PCM16) request of exactly ``max_tokens`` tokens."""
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Read me a story."}],
        max_tokens=max_tokens,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )


async def _audio(client: openai.AsyncOpenAI, model: str, n: int, out: Traffic) -> None:
    trace_id, headers = _traceparent()
    t = time.monotonic()
    stream = await _audio_stream(client, model, n, headers)
    pcm, first, reason, rid = bytearray(), None, None, None
    async for chunk in stream:
        rid = chunk.id
        for c in chunk.choices:
            if c.delta.audio and c.delta.audio.data:
                first = first if first is not None else time.monotonic() - t
                pcm += base64.b64decode(c.delta.audio.data)
            reason = c.finish_reason or reason
    out.latencies.append(time.monotonic() - t)
    assert first is not None and rid and reason, (first, rid, reason)
    out.first_audio.append(first)
    out.frames += len(pcm) // 2
    out.finish[reason] += 1
    out.ids.append(rid)
    out.audio_ids.append(rid)
    out.trace_ids[rid] = trace_id


async def _run_traffic(stack, pipeline, out: Traffic) -> None:
    nc = await nats.connect(stack.nats_url)

    async def on_stage_msg(msg) -> None:
        hdr = msg.headers or {}
        edge = (hdr[h.FROM_STAGE], hdr[h.FROM_REPLICA], hdr[h.TO_STAGE], hdr[h.TO_REPLICA])
        out.bus_bytes[edge] += len(msg.data)
        out.bus_hops[edge] += 1
        task = decode(StageTask, msg.data)
        out.bus_routes[task.request_id][int(edge[2])] = edge[3]
        if edge[2] == "1" and task.token_ids:
            out.talker_requests[edge[3]] += 1

    await nc.subscribe(Subjects(pipeline.name).stages_wildcard, cb=on_stage_msg)
    await nc.flush()
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = pipeline.served_model_name
    await client.models.list()  # the client's first-use costs (connection, headers) are not the server's
    t = time.monotonic()
    await asyncio.gather(
        *(_text(client, model, n, out) for n in TEXT_MAX_TOKENS),
        *(_audio(client, model, n, out) for n in AUDIO_MAX_TOKENS),
    )
    out.seconds = time.monotonic() - t
    out.t1 = time.time()
    await client.close()
    # The last hops of a request may trail its HTTP response. A stage is done (its record says so)
    # after it sent every output; the flush then brings every hop sent before it to our subscriber.
    for rid in out.ids:
        rec = await _done_record(stack, rid)
        out.routes[rid] = rec["route"]
    await nc.flush()
    await nc.close()


async def _done_record(stack, rid: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    """The ``omni_requests`` record of ``rid`` once every stage of its route is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await request_record(stack.nats_url, rid)
        if rec and len(rec["stages"]) == len(rec["route"]) and all(st["done_ns"] for st in rec["stages"]):
            return rec
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid}: not every stage done within {timeout_s} s: {rec}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def traffic(stack, pipeline, prom) -> Traffic:
    quiet = time.time()
    prom.wait_scraped_after(quiet)
    out = Traffic(t0=time.time())
    asyncio.run(_run_traffic(stack, pipeline, out))
    print(
        f"\ntraffic: {len(out.ids)} requests in {out.seconds:.2f} s, finish {dict(out.finish)}, "
        f"{out.frames} audio frames, bus {dict(out.bus_bytes)}"
    )
    return out


# --- the tests -------------------------------------------------------------------------------------------
def test_every_live_service_is_an_up_target_with_its_labels(prom, stack) -> None:
    sd = _sd_labels(stack)
    assert {r["service"] for r in sd.values()} == {"gateway", "orchestrator", "worker"}, sd
    targets = {t["labels"]["instance"]: t for t in prom.targets() if t["labels"]["job"] == "omnirelay"}
    assert sd.keys() <= targets.keys(), (sd.keys(), targets.keys())
    for instance, want in sd.items():
        t = targets[instance]
        assert t["health"] == "up", t
        got = {k: v for k, v in t["labels"].items() if k not in ("job", "instance")}
        assert got == {k: v for k, v in want.items() if v and k != "instance"}, (got, want)
    up = prom.vector('up{job="omnirelay"}', "instance")
    assert all(up[(i,)] == 1 for i in sd), up


def test_scraped_names_keep_their_colons(prom, traffic) -> None:
    """``vllm:*`` names arrive intact (Prometheus 2.x asks for OpenMetrics first on every scrape).

    prometheus_client 0.23-0.26 escapes ':' to '_' in OpenMetrics sample lines but not in their
    # HELP/# TYPE lines (prometheus/client_python#1177): every dashboard query would then be empty."""
    want = {"vllm:omni_e2e_request_latency_s_count", "vllm:request_success_total", "vllm:omni_stage_info"}

    def kept() -> set[str]:
        rows = prom.query('count by (__name__) ({__name__=~"vllm:.+", job="omnirelay"})')
        return {r["metric"]["__name__"] for r in rows}

    # The traffic's families appear at the scrape after it: from then on, nothing may be mangled.
    names = eventually(kept, lambda v: want <= v)
    assert want <= names, names
    mangled = prom.query('count by (__name__) ({__name__=~"vllm_.+", job="omnirelay"})')
    assert not mangled, "scraped as vllm_* instead of vllm:*: " + ", ".join(
        sorted(r["metric"]["__name__"] for r in mangled)[:10]
    )


def test_finish_reasons_match_what_the_client_saw(prom, traffic, pipeline) -> None:
    sel = f'vllm:omni_requests_success_total{{pipeline="{pipeline.name}"}}'
    want = {(reason,): float(n) for reason, n in traffic.finish.items()}
    got = eventually(
        lambda: {k: v for k, v in prom.grown(sel, "finished_reason", traffic.t0).items() if v},
        lambda v: v == want,
    )
    assert got == want


def test_transfer_bytes_per_edge_equal_the_bytes_on_the_bus(prom, traffic, pipeline) -> None:
    by = "from_stage, from_replica, to_stage, to_replica"
    want_bytes = {k: float(v) for k, v in traffic.bus_bytes.items()}
    want_hops = {k: float(v) for k, v in traffic.bus_hops.items()}
    assert {e[2] for e in want_bytes} == {"0", "1", "2"}, want_bytes
    assert any(e[0] == h.FROM_ORCHESTRATOR for e in want_bytes), want_bytes

    def both() -> tuple[dict, dict]:
        at = time.time()
        sizes = prom.grown(
            f'vllm:omni_transfer_size_bytes_sum{{pipeline="{pipeline.name}"}}', by, traffic.t0, at
        )
        hops = prom.grown(
            f'vllm:omni_transfer_size_bytes_count{{pipeline="{pipeline.name}"}}', by, traffic.t0, at
        )
        return {k: v for k, v in sizes.items() if v}, {k: v for k, v in hops.items() if v}

    sizes, hops = eventually(both, lambda v: v == (want_bytes, want_hops))
    assert sizes == want_bytes
    assert hops == want_hops


def test_latency_and_audio_sums_agree_with_the_client(prom, traffic, pipeline) -> None:
    n, n_audio = len(traffic.latencies), len(traffic.first_audio)
    gw = f'{{pipeline="{pipeline.name}", service="gateway"}}'

    def read() -> dict[str, float]:
        at = time.time()
        names = {
            "e2e_count": "vllm:omni_e2e_request_latency_s_count",
            "e2e_sum": "vllm:omni_e2e_request_latency_s_sum",
            "ttfp_count": "vllm:omni_audio_ttfp_s_count",
            "ttfp_sum": "vllm:omni_audio_ttfp_s_sum",
            "duration_sum": "vllm:omni_audio_duration_s_sum",
            "frames": "vllm:omni_audio_frames_total",
        }
        return {
            k: sum(prom.grown(f"{name}{gw}", "pipeline", traffic.t0, at).values())
            for k, name in names.items()
        }

    got = eventually(
        read, lambda v: v["e2e_count"] == n and v["ttfp_count"] == n_audio and v["frames"] == traffic.frames
    )
    assert got["e2e_count"] == n and got["ttfp_count"] == n_audio
    e2e_gap = sum(traffic.latencies) - got["e2e_sum"]
    ttfp_gap = sum(traffic.first_audio) - got["ttfp_sum"]
    print(
        f"\nclient - server: e2e {e2e_gap * 1000:.1f} ms over {n} requests, "
        f"ttfp {ttfp_gap * 1000:.1f} ms over {n_audio} audio requests"
    )
    assert 0 <= e2e_gap <= n * LATENCY_SLACK_S, (traffic.latencies, got)
    assert 0 <= ttfp_gap <= n_audio * LATENCY_SLACK_S, (traffic.first_audio, got)
    assert got["frames"] == traffic.frames
    assert got["duration_sum"] == pytest.approx(traffic.frames / SR, rel=1e-9)


def test_engine_requests_per_replica_match_the_routes(prom, traffic, pipeline, stack) -> None:
    workers = [g for g in sd_groups(stack) if g["labels"]["__meta_omnirelay_service"] == "worker"]
    llm = [
        g for g in workers if pipeline.stages[int(g["labels"]["__meta_omnirelay_stage"])].type.value == "llm"
    ]
    exposed = {
        fam.name
        for g in llm
        for fam in text_string_to_metric_families(
            httpx.get(f"http://{g['targets'][0]}/metrics", timeout=30).text
        )
    }
    assert "vllm:request_success" in exposed, "an llm worker's /metrics lacks vLLM's engine families"
    # The records' routes are where the messages went (the subscriber saw each stage's replica).
    assert {
        rid: [int(r) for _, r in sorted(traffic.bus_routes[rid].items())] for rid in traffic.ids
    } == traffic.routes
    thinker = Counter(str(route[0]) for route in traffic.routes.values())
    want = {("0", r): float(n) for r, n in thinker.items()}
    want |= {("1", r): float(n) for r, n in traffic.talker_requests.items()}
    talkers = {str(traffic.routes[i][1]) for i in traffic.audio_ids}
    assert talkers == set(traffic.talker_requests), traffic.routes
    sel = f'vllm:request_success_total{{pipeline="{pipeline.name}", service="worker"}}'
    got = eventually(
        lambda: {k: v for k, v in prom.grown(sel, "stage, replica", traffic.t0).items() if v},
        lambda v: v == want,
    )
    print(f"\nengine requests per (stage, replica): {got}")
    assert got == want


def test_every_engine_process_is_scraped_with_its_worker_labels(prom, traffic, pipeline, stack) -> None:
    """The engine processes vLLM runs beside each ``llm`` worker are federated under that worker's
    stage and replica, and those that served the traffic used CPU meanwhile."""
    llm = {
        (g["labels"]["__meta_omnirelay_stage"], g["labels"]["__meta_omnirelay_replica"])
        for g in sd_groups(stack)
        if g["labels"]["__meta_omnirelay_service"] == "worker"
        and pipeline.stages[int(g["labels"]["__meta_omnirelay_stage"])].type.value == "llm"
    }
    served = {("0", str(route[0])) for route in traffic.routes.values()}
    served |= {("1", str(r)) for r in traffic.talker_requests}
    assert served <= llm
    for namespace in ENGINE_PROCESSES:
        sel = f'{namespace}_process_cpu_seconds_total{{pipeline="{pipeline.name}", service="worker"}}'
        got = eventually(
            lambda sel=sel: prom.grown(sel, "stage, replica", traffic.t0),
            lambda v: set(v) == llm and all(v[k] > 0 for k in served),
        )
        assert set(got) == llm, (namespace, got)
        assert all(got[k] > 0 for k in served), (namespace, got)


def _check_unified(metric: dict[str, str], sd: dict[str, dict[str, str]]) -> list[str]:
    """Problems with one series' labels (empty if it follows the scheme)."""
    name = metric.get("__name__", "")
    problems = [f"{name}: {k}" for k in metric if k.startswith("exported_")]
    if metric.get("job") == "prometheus":
        return problems + ([] if metric.get("service") == "prometheus" else [f"{name}: {metric}"])
    missing = [k for k in UNIFIED if not metric.get(k)]
    if missing:
        return [*problems, f"{name}: missing {missing} in {metric}"]
    target = sd.get(metric["instance"])
    if target is None:
        return [*problems, f"{name}: instance {metric['instance']} is no SD target"]
    for label in ("service", "pipeline", *WORKER_LABELS):
        if target.get(label):
            if metric.get(label) != target[label]:
                problems.append(f"{name}: {label}={metric.get(label)!r}, target says {target[label]!r}")
        elif label in OWN_STAGE_LABELS.get(name, ()):
            if not metric.get(label):
                problems.append(f"{name}: no {label} of its own on a {metric['service']}")
        elif label in metric:
            problems.append(f"{name}: unexpected {label}={metric[label]!r} on a {metric['service']}")
    return problems


def _sd_labels(stack) -> dict[str, dict[str, str]]:
    return {
        g["labels"]["__meta_omnirelay_instance"]: {
            k.removeprefix("__meta_omnirelay_"): v
            for k, v in g["labels"].items()
            if k.startswith("__meta_omnirelay_")
        }
        for g in sd_groups(stack)
    }


def test_prometheus_stores_the_trace_id_exemplars(prom, traffic, stack) -> None:
    """Scraped as OpenMetrics, the latency histograms' exemplars land in Prometheus's exemplar
    storage with the trace ids of the requests that made them."""
    trace_ids = set(traffic.trace_ids.values())
    assert len(trace_ids) == len(traffic.ids)
    # The gateway continued each client's trace (the request's record names it) ...
    records = {rid: asyncio.run(request_record(stack.nats_url, rid))["trace_id"] for rid in traffic.ids}
    assert records == traffic.trace_ids
    # ... and the exemplars lead to those traces.
    prom.wait_scraped_after(traffic.t1)
    window = {"start": f"{traffic.t0 - 5:.3f}", "end": f"{time.time() + 5:.3f}"}
    for family in ("vllm:omni_e2e_request_latency_s_bucket", "vllm:omni_transfer_in_flight_s_bucket"):
        series = prom.api("query_exemplars", query=family, **window)
        stored = {ex["labels"]["trace_id"] for s in series for ex in s["exemplars"]}
        assert stored & trace_ids, (family, stored)
        assert all(len(t) == 32 and int(t, 16) >= 0 for t in stored)  # trace ids, 32 hex digits


def test_every_series_carries_the_unified_labels(prom, traffic, stack, pipeline) -> None:
    sd = _sd_labels(stack)
    series = prom.api("series", **{"match[]": '{__name__=~".+"}', "start": f"{traffic.t0:.3f}"})
    assert len(series) > 500, len(series)
    services = Counter(s.get("service") for s in series)
    assert {"gateway", "orchestrator", "worker", "prometheus"} <= services.keys(), services
    problems = [p for s in series for p in _check_unified(s, sd)]
    assert not problems, "\n".join(problems[:30])
    # Engine and omnirelay families of a worker keep the worker's own stage/replica (honor_labels):
    # every worker of the stack has its stage_info, every llm worker vLLM's engine gauges.
    workers = {i for i, t in sd.items() if t["service"] == "worker" and t["pipeline"] == pipeline.name}
    llm = {i for i in workers if pipeline.stages[int(sd[i]["stage"])].type.value == "llm"}
    assert llm and llm < workers, (llm, workers)
    for name, want in (("vllm:num_requests_running", llm), ("vllm:omni_stage_info", workers)):
        rows = [s for s in series if s["__name__"] == name]
        assert want <= {s["instance"] for s in rows}, (name, want, rows)
        for s in rows:
            assert (s["stage"], s["replica"]) == (sd[s["instance"]]["stage"], sd[s["instance"]]["replica"]), s


def test_federate_exposes_the_same_labels(prom, traffic, stack) -> None:
    sd = _sd_labels(stack)
    match = '{__name__=~"vllm:omni_.*"}'

    def both() -> tuple[set, set]:
        text = prom.http.get("/federate", params={"match[]": match}).text
        fed = {
            (s.name, frozenset(s.labels.items()))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        direct = {
            (r["metric"]["__name__"], frozenset((k, v) for k, v in r["metric"].items() if k != "__name__"))
            for r in prom.query(match)
        }
        return fed, direct

    fed, direct = eventually(both, lambda v: v[0] == v[1], timeout_s=5)
    assert fed == direct, (len(fed), len(direct), list(fed ^ direct)[:5])
    names = {n for n, _ in fed}
    assert {
        "vllm:omni_stage_info",
        "vllm:omni_e2e_request_latency_s_bucket",
        "vllm:omni_transfer_size_bytes_sum",
    } <= names
    problems = [p for n, labels in fed for p in _check_unified({"__name__": n, **dict(labels)}, sd)]
    assert not problems, "\n".join(problems[:30])


@dataclass
class Events:
    """What the ``events`` fixture caused, as the client and the bus saw it."""

    t0: float
    rejected: int = 0
    """Audio requests whose stream ended with ``codec_input_rejected``."""
    chunks_after_pause: int = 0
    """Audio chunks a stream got after its audio stage was stopped for ``PAUSE_S``."""
    victim: int | None = None
    """The thinker replica killed under two streams."""
    moved: int = 0
    """Streams whose record lists a second stage-0 attempt (moved off the victim)."""
    stale_sent: bool = False
    """The dead attempt's stale event and chunk were sent after its request moved."""
    t1: float = 0.0


def _bad_chunk(task_of: dict[str, Any], codes: list[int]) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=task_of["request_id"],
        gateway_id=task_of["gateway_id"],
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=task_of["route"],
        kind=TaskKind.CHUNK,
        seq=0,
        final=True,
        codes=NdArray.of(np.asarray(codes, dtype=np.int32)),
    )


async def _reject_one(stack, pipeline, js, client: openai.AsyncOpenAI) -> bool:
    """An audio request whose first code chunk the test corrupts: codes out of the codec's range,
    sent to its code2wav replica as chunk 0 as soon as stage 0 has started (long before the talker's
    own chunk 0, which the stream then drops as a duplicate). True when the stream ended with
    ``codec_input_rejected`` (False: the talker's chunk got there first)."""
    stream = await _audio_stream(client, pipeline.served_model_name, 60)
    subjects = Subjects(pipeline.name)
    try:
        async for chunk in stream:
            rec = None
            for _ in range(50):
                rec = await request_record(stack.nats_url, chunk.id)
                if rec:
                    break
                await asyncio.sleep(0.01)
            assert rec, f"no record of {chunk.id}"
            bad = _bad_chunk(rec, [5, 1 << 20])
            audio = pipeline.audio_stage
            hop = Hop(str(audio - 1), str(rec["route"][audio - 1]), audio, rec["route"][audio])
            await publish_task(js, subjects, bad, hop)
            async for _ in stream:
                pass
            return False
    except openai.APIError as e:
        assert e.code == "codec_input_rejected", e
        return True
    return False


BUSY_TOKENS = 300
"""Tokens of the audio stream under the thinker that is killed."""
TEXT_BUSY_TOKENS = 1200
"""Tokens of the text stream beside it, so the two share the thinker for the whole fault."""
LEAD_TOKENS = 10
"""Tokens each stream has had from the thinker when it is killed."""
STALE_SEQ = 10_000
"""The ``seq`` of the stale event and chunk: past any the dead attempt sent (a chunk's
``Nats-Msg-Id`` then is new to the stream, which would drop a repeat before any worker saw it)."""

PAUSE_S = 2.0
"""How long the audio stage is stopped mid-stream: four times a chunk's 0.5 s of audio."""


async def _pause_the_audio_stage(stack, pipeline, client: openai.AsyncOpenAI) -> int:
    """A streamed audio request whose audio stage (its only replica) is stopped (``SIGSTOP``) for
    ``PAUSE_S`` after the first audio chunk, well inside its ``stall_timeout_s``: the client's player
    runs dry and the next chunk is late. Audio that still arrives while the stage is stopped (sent
    before the stop: on a loaded box the client reads behind the server) lengthens the pause by its
    duration, so the player runs dry whatever was in flight. Returns the chunks that came after
    the pause."""
    pid = worker_pid(stack.proc.pid, pipeline.audio_stage, 0)
    stream = await _audio_stream(client, pipeline.served_model_name, 60)
    chunks: asyncio.Queue[float | None] = asyncio.Queue()  # seconds of audio per chunk; None: end

    async def read() -> None:
        async for chunk in stream:
            data = "".join(c.delta.audio.data for c in chunk.choices if c.delta.audio and c.delta.audio.data)
            if data:
                chunks.put_nowait(len(base64.b64decode(data)) / 2 / SR)
        chunks.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        assert await asyncio.wait_for(chunks.get(), 60) is not None, "no audio at all"
        try:
            await stop_confirmed(pid, "the audio stage", timeout_s=1.0)
            until = time.monotonic() + PAUSE_S
            while (left := until - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    seconds = await asyncio.wait_for(chunks.get(), left)
                    assert seconds is not None, "the stream ended while its audio stage was stopped"
                    until += seconds
        finally:
            os.kill(pid, signal.SIGCONT)
        after = 0
        while await asyncio.wait_for(chunks.get(), 60) is not None:
            after += 1
        return after
    finally:
        reader.cancel()


async def _stale_after_the_move(pipeline, nc: nats.NATS, rec: dict[str, Any], victim: int) -> None:
    """What a dead thinker attempt could still have had on the way when its request moved on, sent
    as that attempt (1) would have: a text event to the gateway and a text chunk to the talker. The
    gateway and the talker were told of attempt 2 (the ``moved`` notice) and drop them as stale."""
    subjects, rid, now = Subjects(pipeline.name), rec["request_id"], time.time_ns()
    event = ClientEvent(
        request_id=rid,
        type=ClientEventType.TEXT,
        stage=0,
        replica=victim,
        seq=STALE_SEQ,
        text=" stale",
        attempt=1,
    )
    await nc.publish(subjects.out(rec["gateway_id"], rid), event.encode())
    chunk = StageTask(
        request_id=rid,
        gateway_id=rec["gateway_id"],
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=rec["route"],
        kind=TaskKind.CHUNK,
        seq=STALE_SEQ,
        token_ids=[1, 2, 3],
        text=" stale",
        attempt=len(rec["stages"][1]["attempts"]) or 1,
        from_attempt=1,
    )
    await publish_task(nc.jetstream(), subjects, chunk, Hop("0", str(victim), 1, rec["route"][1]))


async def _kill_a_busy_thinker(
    stack, pipeline, nc: nats.NATS, client: openai.AsyncOpenAI, out: Events
) -> None:
    """A streamed audio request and a text stream of ``BUSY_TOKENS`` tokens; once the text stream
    has text and the thinker has sent the talker ``LEAD_TOKENS`` of the audio request's tokens (seen
    on the bus by a subscriber of our own), ``kill -9`` the thinker replica the audio request runs on. Once it has moved, and while its
    talker still works on it, the dead attempt's stale event and chunk are sent
    (``_stale_after_the_move``). Both streams complete; the launcher's replacement is awaited."""
    services = (await snapshot(stack.nats_url, pipeline))["services"]
    incarnations = {s["key"]: s["started_ns"] for s in services}
    ids: list[str] = ["", ""]
    tokens = [0, 0]

    async def stream(i: int) -> None:
        model = pipeline.served_model_name
        s = (
            await _audio_stream(client, model, BUSY_TOKENS)
            if i == 0
            else await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Count to a thousand."}],
                max_tokens=TEXT_BUSY_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        async for chunk in s:
            ids[i] = chunk.id
            d = chunk.choices[0].delta if chunk.choices else None
            tokens[i] += bool(d and (d.content or (d.audio and d.audio.transcript)))

    # The thinker's tokens of the audio request as the talker's input carries them: the client's
    # transcript waits for the talker and code2wav, and once came after the thinker had finished.
    to_talker: Counter[str] = Counter()

    async def on_chunk(msg) -> None:
        task = decode(StageTask, msg.data)
        if task.kind == TaskKind.CHUNK:
            to_talker[task.request_id] += len(task.token_ids)

    sub = await nc.subscribe(Subjects(pipeline.name).stage_in(1, "*"), cb=on_chunk)
    streams = [asyncio.create_task(stream(i)) for i in (0, 1)]
    deadline = time.monotonic() + 60
    # Only the audio request has a talker stage.
    while (
        (tokens[1] < LEAD_TOKENS or max(to_talker.values(), default=0) < LEAD_TOKENS)
        and time.monotonic() < deadline
        and not any(s.done() for s in streams)
    ):
        await asyncio.sleep(0.025)
    await sub.unsubscribe()
    assert tokens[1] >= LEAD_TOKENS and max(to_talker.values(), default=0) >= LEAD_TOKENS, (
        f"within 60 s: text stream {tokens[1]} tokens, to the talker {dict(to_talker)}"
    )
    (audio_id,) = to_talker
    rec = await request_record(stack.nats_url, audio_id)
    assert rec and not rec["stages"][0]["done_ns"], rec
    out.victim = rec["route"][0]
    await kill_confirmed(worker_pid(stack.proc.pid, 0, out.victim), "the thinker worker")
    # Moved: the record's new attempt has its input sent, which the orchestrator does after it
    # told the workers (the moved notice) and the gateway (its question fences the old attempt).
    deadline = time.monotonic() + 10
    while True:
        rec = await request_record(stack.nats_url, audio_id)
        last = rec["stages"][0]["attempts"][-1]
        if last["attempt"] > 1 and last["sent_ns"]:
            break
        assert time.monotonic() < deadline, f"not moved within 10 s of the kill: {rec}"
        await asyncio.sleep(0.05)
    # The talker has taken the moved notice (it logs so): the dead attempt's chunks are stale there.
    await stack.await_log(f"request {audio_id}: stage 0 moved to attempt {last['attempt']}")
    assert not streams[0].done() and not rec["stages"][1]["done_ns"], "the audio request ended too soon"
    await _stale_after_the_move(pipeline, nc, rec, out.victim)
    out.stale_sent = True
    await asyncio.wait_for(asyncio.gather(*streams), 120)
    for rid in ids:
        rec = await request_record(stack.nats_url, rid)
        out.moved += len(rec["stages"][0]["attempts"]) > 1
    key = f"worker.{pipeline.name}.0.{out.victim}"
    await await_replacement(stack.nats_url, pipeline, key, incarnations[key])  # whole for the tests after


async def _cause_events(stack, pipeline, out: Events) -> None:
    nc = await nats.connect(stack.nats_url)
    js = nc.jetstream()
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        for _ in range(3):  # the race is the test's to lose only if the talker is very fast
            if await _reject_one(stack, pipeline, js, client):
                out.rejected = 1
                break
        out.chunks_after_pause = await _pause_the_audio_stage(stack, pipeline, client)
        await _kill_a_busy_thinker(stack, pipeline, nc, client, out)
        subjects = Subjects(pipeline.name)
        audio = pipeline.audio_stage
        to_codec = {h.TO_STAGE: str(audio), h.TO_REPLICA: "0"}
        await js.publish(subjects.stage_in(audio, 0), b"\xc1", headers=to_codec)  # not msgpack
        ahead = time.time_ns() + 5 * 10**9  # a sender whose clock runs 5 s ahead
        skewed = _bad_chunk(
            {"request_id": f"skew-{uuid.uuid4().hex}", "gateway_id": "nobody", "route": [0, 0, 0]}, [1, 2]
        )
        await js.publish(
            subjects.stage_in(audio, 0),
            skewed.encode(),
            headers={
                **to_codec,
                h.REQUEST_ID: skewed.request_id,
                h.FROM_STAGE: str(audio - 1),
                h.FROM_REPLICA: "0",
                h.SEQ: "0",
                h.FINAL: "true",
                h.TX_START_NS: str(ahead),
                h.TX_END_NS: str(ahead + 1000),
            },
        )
    finally:
        await client.close()
        await nc.close()
    out.t1 = time.time()


@pytest.fixture(scope="module")
def events(stack, pipeline, prom, traffic) -> Events:
    """Events the traffic does not cause, caused for real after it (the tests comparing the
    traffic's counts have run by then): a codec rejection (a failure and a skipped audio request at
    the gateway), an audio stage stopped for 2 s mid-stream (late chunks), a thinker killed under
    two streams (an eviction and a move) and the dead attempt's stale event and chunk (dropped by
    the gateway and the talker), a malformed stage message (terminated by its worker) and a chunk
    from a sender whose clock runs ahead (two clamped intervals)."""
    prom.wait_scraped_after(traffic.t1 + 1.0)
    out = Events(t0=time.time())
    asyncio.run(_cause_events(stack, pipeline, out))
    return out


def _outside_codec_worker(stack, pipeline: str, tmp: Path, **env: str) -> tuple[str, ServiceProcess]:
    """A code2wav worker of pipeline ``pipeline`` on the stack's NATS, started outside the stack
    (``--log-stats``, its own instance id, ``env`` added); returns (instance id, process)."""
    path = write_pipeline(tmp / "p.yaml", pipeline, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    instance = f"{pipeline}-{uuid.uuid4().hex[:8]}"
    env = {
        "NATS_URL": stack.nats_url,
        "OMNIRELAY_PIPELINE": str(path),
        "OMNIRELAY_STAGE": "2",
        "OMNIRELAY_INSTANCE_ID": instance,
        **env,
    }
    return instance, ServiceProcess(["worker", "--log-stats"], env, tmp / "worker.log").start()


@dataclass
class DeadLetter:
    """A message JetStream dropped past ``max_deliver`` (``dead_lettered``)."""

    instance: str
    """The worker whose consumer it was on."""
    advisories: int
    """Max-deliveries advisories the test saw."""
    t0: float
    t1: float


@pytest.fixture(scope="module")
def dead_lettered(stack, prom, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeadLetter]:
    """A code2wav worker of another pipeline (``DEAD_PIPELINE``), started outside the stack with a
    1 s ``ack_wait`` (the stack's consumers keep their 30 s, whose redeliveries would take 4 min),
    loses a message past ``max_deliver`` (``tests.bus.dead_letter``). It runs until the module's
    end: its counter stays a live series for the dashboard check."""
    instance, worker = _outside_codec_worker(
        stack, DEAD_PIPELINE, tmp_path_factory.mktemp("deadletter"), OMNIRELAY_ACK_WAIT_S="1"
    )
    try:
        worker.wait_log("serving omni.", timeout_s=120)
        assert eventually(lambda: prom.scalar(f'up{{instance="{instance}"}}'), lambda v: v == 1) == 1
        t0 = time.time()
        held = _bad_chunk(
            {"request_id": f"dead-{uuid.uuid4().hex}", "gateway_id": "nobody", "route": [0, 0, 0]}, [1, 2]
        )
        held = held.model_copy(update={"seq": 1, "final": False})  # chunk 0 never comes: it is held

        async def lose() -> int:
            nc = await nats.connect(stack.nats_url)
            try:
                return await dead_letter(
                    nc, Subjects(DEAD_PIPELINE), Hop("1", "0", 2, 0), held, worker.proc.pid
                )
            finally:
                await nc.close()

        advisories = asyncio.run(lose())
        # The worker counts the advisory when it runs again (it was stopped when the advisory came),
        # and logs it just before; t1 is after that.
        worker.wait_log("reached max_deliver", timeout_s=30)
        t1 = time.time()
        # Stopped for longer than the registry's TTL, it left the service discovery meanwhile: its
        # series are stale until it is listed and scraped again.
        listed = eventually(
            lambda: instance in {g["labels"]["__meta_omnirelay_instance"] for g in prom.sd()}, bool
        )
        assert listed, f"{instance} did not come back to the service discovery"
        yield DeadLetter(instance, advisories, t0, t1)
    finally:
        assert worker.stop() == 0, worker.text()[-2000:]


def grew(prom: Prometheus, name: str, by: str, t0: float) -> dict[tuple[str, ...], float]:
    """How much ``name`` grew since ``t0``, summed by ``by``, leaving out what did not grow (series
    of earlier tests' events are there too). Taken per process (``instance``): a process that died
    since (its series gone) must not count as a fall, and its replacement counts from 0."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for key, value in prom.grown(name, f"{by}, instance", t0).items():
        if value:
            out[key[:-1]] += value
    return dict(out)


def test_caused_events_reach_prometheus_as_they_happened(prom, events, dead_lettered) -> None:
    assert events.rejected == 1, "no request was rejected by the codec in 3 tries"
    prom.wait_scraped_after(events.t1)
    for name, by, want in (
        ("vllm:omni_requests_failed_total", "reason", {("codec_input_rejected",): 1.0}),
        ("vllm:omni_audio_skipped_requests_total", "reason", {("codec_input_rejected",): 1.0}),
        ("vllm:omni_bus_messages_terminated_total", "reason", {("not_msgpack",): 1.0}),
        ("vllm:omni_transfer_clock_skew_clamps_total", "interval", {("in_flight",): 1.0, ("publish",): 1.0}),
    ):
        got = eventually(lambda n=name, b=by: grew(prom, n, b, events.t0), lambda v, w=want: v == w)
        assert got == want, (name, got)
    assert events.victim is not None and events.moved >= 1, events
    victim = str(events.victim)
    for name, by, want in (
        ("vllm:omni_replica_evictions_total", "stage, replica, reason", {("0", victim, "exit"): 1.0}),
        (
            "vllm:omni_requests_migrated_total",
            "stage, from_replica, reason",
            {("0", victim, "exit"): float(events.moved)},
        ),
    ):
        got = eventually(lambda n=name, b=by: grew(prom, n, b, events.t0), lambda v, w=want: v == w)
        assert got == want, (name, got)
    assert events.stale_sent, events
    got = eventually(
        lambda: grew(prom, "vllm:omni_stale_events_dropped_total", "stage", events.t0),
        lambda v: v == {("0",): 1.0},
    )
    assert got == {("0",): 1.0}, got
    # The chunk the test sent is dropped; so would be a chunk of the dead attempt's that the talker
    # had not taken before the move (none is expected: it died 0.5 s and more before).
    got = eventually(
        lambda: grew(prom, "vllm:omni_stale_chunks_dropped_total", "stage", events.t0),
        lambda v: v.get(("1",), 0) >= 1,
    )
    assert set(got) == {("1",)} and got[("1",)] >= 1, got
    assert dead_lettered.advisories == 1, "no max-deliveries advisory within 30 s"
    prom.wait_scraped_after(dead_lettered.t1)
    selector = f'vllm:omni_bus_dead_lettered_total{{instance="{dead_lettered.instance}"}}'
    got = eventually(lambda: prom.grown(selector, "stage", dead_lettered.t0), lambda v: v == {("2",): 1.0})
    assert got == {("2",): 1.0}, got
    assert events.chunks_after_pause >= 1, "no audio came after the pause"
    late = eventually(
        lambda: sum(prom.grown("vllm:omni_audio_late_chunks_total", "pipeline", events.t0).values()),
        lambda v: v >= 1,
    )
    assert 1 <= late <= events.chunks_after_pause, late


def test_every_dashboard_query_runs_and_has_data(prom, traffic, events, dead_lettered) -> None:
    """Each dashboard query (variables at All) is valid for this Prometheus and returns series:
    the traffic and the caused events give every family it reads data."""
    # rate() needs two samples: two scrapes of every listed service after the last event (a
    # counter an event creates is exported only from then on). What the services counted a little
    # after the events' end (a worker handles the last messages the test sent after it sent
    # them) may take a few scrapes more: a query may take until WAIT_S to have data.
    prom.wait_scraped_after(max(traffic.t1, events.t1, dead_lettered.t1), scrapes=2)
    pending = {
        where: grafana_to_promql(
            expr[len("query_result(") : -1] if expr.startswith("query_result(") else expr
        )
        for where, expr in dashboard_queries(json.loads(DASHBOARD.read_text()))
    }
    deadline = time.monotonic() + WAIT_S
    while True:
        pending = {where: q for where, q in pending.items() if not prom.query(q)}  # asserts status success
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    present = set(prom.api("label/__name__/values"))
    problems = [
        f"{where}: {sorted(metric_names(q) - present)} not in Prometheus"
        if metric_names(q) - present
        else f"{where}: {q}"
        for where, q in pending.items()
    ]
    assert not problems, "\n".join(problems)


def test_a_replica_that_joins_is_scraped_and_one_that_leaves_goes_stale(prom, stack, tmp_path: Path) -> None:
    """A code2wav worker of another pipeline, started outside the stack: Prometheus scrapes it
    without any configuration change; when it stops its target disappears and its series go stale."""
    config_time = prom.api("status/runtimeinfo")["lastConfigTime"]
    instance, worker = _outside_codec_worker(stack, DYN_PIPELINE, tmp_path)
    try:
        worker.wait_log("serving omni.", timeout_s=120)
        t_join = time.monotonic()
        info = (
            f'vllm:omni_stage_info{{instance="{instance}", service="worker", pipeline="{DYN_PIPELINE}", '
            f'stage="2", replica="0", stage_name="code2wav", stage_type="codec"}}'
        )
        up = eventually(lambda: prom.scalar(f'up{{instance="{instance}"}}'), lambda v: v == 1)
        assert up == 1, prom.targets()
        assert eventually(lambda: prom.scalar(info), lambda v: v == 1) == 1
        joined_s = time.monotonic() - t_join
    finally:
        t_leave = time.monotonic()
        assert worker.stop() == 0, worker.text()[-2000:]

    def gone() -> bool:
        listed = any(t["labels"].get("instance") == instance for t in prom.targets())
        return not listed and not prom.query(f'up{{instance="{instance}"}}') and not prom.query(info)

    assert eventually(gone, bool), prom.targets()
    left_s = time.monotonic() - t_leave
    # Stale, not forgotten: the samples it had are still there over a range.
    assert prom.scalar(f"count_over_time({info}[5m])") >= 1
    assert prom.api("status/runtimeinfo")["lastConfigTime"] == config_time, "no configuration change"
    print(
        f"\nnew replica scraped {joined_s:.1f} s after it served; its series stale {left_s:.1f} s after SIGTERM"
    )
