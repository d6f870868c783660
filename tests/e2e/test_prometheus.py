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
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common import headers as h
from libs.common.metrics_catalog import ENGINE_PROCESSES
from libs.common.pipeline import load_pipeline
from libs.stack.bus_state import request_record
from tests.e2e.prometheus_events import (
    SR,
    outside_codec_worker,
    wait_registered,
)
from tests.e2e.prometheus_server import WAIT_S, Prometheus, eventually, sd_groups
from tests.e2e.prometheus_traffic import Traffic, run_traffic
from tests.unit.test_dashboard import DASHBOARD, dashboard_queries, grafana_to_promql, metric_names

pytestmark = pytest.mark.e2e

LATENCY_SLACK_S = 0.25
"""Per request: the client's clock (before sending → after reading the last byte, or the first
audio chunk) may exceed the gateway's arrival → last byte / first audio written by at most this,
on loopback, with the five requests running concurrently in one client event loop."""
DYN_PIPELINE = "promdyn"
THINKER, TALKER = load_pipeline().thinker_stage, load_pipeline().speech_stage
"""The stack's (the default pipeline's) thinker and talker stage ids."""
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
        # docs/contract.md, "Metrics: names and labels": the gateway's audio families carry
        # {model_name, stage, replica} of the stage that produced the audio (vLLM-Omni's, and beyond
        # them the arrival-anchored RTF, the stream denominator and late-chunk counts).
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
carries none (the gateway, the orchestrator), written out from docs/contract.md and docs/reliability.md,
not read from the metric catalog: a gateway or orchestrator family that wrongly declares ``stage``
or ``replica`` shows as an unexpected label, one that lacks its own as a missing one."""


@pytest.fixture(scope="module")
def traffic(stack, pipeline, prom) -> Traffic:
    quiet = time.time()
    prom.wait_scraped_after(quiet)
    out = Traffic(t0=time.time())
    asyncio.run(run_traffic(stack, pipeline, out))
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
    ran = {str(i) for i in range(pipeline.thinker_stage, len(pipeline.stages))}
    assert {e[2] for e in want_bytes} == ran, want_bytes  # chat traffic: from the thinker on
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
    want = {(str(THINKER), r): float(n) for r, n in thinker.items()}
    want |= {(str(TALKER), r): float(n) for r, n in traffic.talker_requests.items()}
    talkers = {str(traffic.routes[i][1]) for i in traffic.audio_ids}
    assert talkers == set(traffic.talker_requests), traffic.routes
    sel = f'vllm:request_success_total{{pipeline="{pipeline.name}", service="worker"}}'
    got = eventually(
        lambda: {k: v for k, v in prom.grown(sel, "stage, replica", traffic.t0).items() if v},
        lambda v: v == want,
    )
    print(f"\nengine requests per (stage, replica): {got}")
    assert got == want


ENGINE_CORE = "vllm:omni_engine_core"
"""The EngineCore's namespace among :data:`ENGINE_PROCESSES`."""


def test_every_engine_process_is_scraped_with_its_worker_labels(prom, traffic, pipeline, stack) -> None:
    """The engine processes vLLM runs beside each ``llm`` worker are federated under that worker's
    stage and replica, and those that served the traffic used CPU meanwhile. Each engine here is
    one process (services/stage_worker/engine_executor.py): the Worker family is absent."""
    llm = {
        (g["labels"]["__meta_omnirelay_stage"], g["labels"]["__meta_omnirelay_replica"])
        for g in sd_groups(stack)
        if g["labels"]["__meta_omnirelay_service"] == "worker"
        and pipeline.stages[int(g["labels"]["__meta_omnirelay_stage"])].type.value == "llm"
    }
    served = {(str(THINKER), str(route[0])) for route in traffic.routes.values()}
    served |= {(str(TALKER), str(r)) for r in traffic.talker_requests}
    assert served <= llm
    assert ENGINE_CORE in ENGINE_PROCESSES
    for namespace in ENGINE_PROCESSES:
        sel = f'{namespace}_process_cpu_seconds_total{{pipeline="{pipeline.name}", service="worker"}}'
        if namespace != ENGINE_CORE:
            assert prom.query(sel) == [], namespace
            continue
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
        (
            "vllm:omni_replica_evictions_total",
            "stage, replica, reason",
            {(str(THINKER), victim, "exit"): 1.0},
        ),
        (
            "vllm:omni_requests_migrated_total",
            "stage, from_replica, reason",
            {(str(THINKER), victim, "exit"): float(events.moved)},
        ),
    ):
        got = eventually(lambda n=name, b=by: grew(prom, n, b, events.t0), lambda v, w=want: v == w)
        assert got == want, (name, got)
    assert events.stale_sent, events
    got = eventually(
        lambda: grew(prom, "vllm:omni_stale_events_dropped_total", "stage", events.t0),
        lambda v: v == {(str(THINKER),): 1.0},
    )
    assert got == {(str(THINKER),): 1.0}, got
    # The chunk the test sent is dropped; so would be a chunk of the dead attempt's that the talker
    # had not taken before the move (none is expected: it died 0.5 s and more before).
    got = eventually(
        lambda: grew(prom, "vllm:omni_stale_chunks_dropped_total", "stage", events.t0),
        lambda v: v.get((str(TALKER),), 0) >= 1,
    )
    assert set(got) == {(str(TALKER),)} and got[(str(TALKER),)] >= 1, got
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
    instance, worker = outside_codec_worker(stack, DYN_PIPELINE, tmp_path)
    try:
        wait_registered(stack, DYN_PIPELINE, worker)
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
