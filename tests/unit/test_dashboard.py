"""The Grafana dashboard (compose/grafana/dashboards/omnirelay.json) refers only to metrics that exist.

Every PromQL expression of the dashboard (panel targets and templating queries) is tokenized and
each metric name it uses must be an exposed sample name of a family omnirelay exports
(:data:`libs.common.metrics_catalog.FAMILIES`, via ``exposed_names``) or of the families vLLM's
``PrometheusStatLogger`` registers (derived by constructing it on a tiny ``VllmConfig`` in a fresh
registry, the way the workers construct it). A misspelled family fails the test (checked on a
deliberately broken copy). With ``promtool`` installed (``make prometheus-bin``) every expression is
also parsed by Prometheus' own parser.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from libs.common.metrics_catalog import FAMILIES, engine_process_names, exposed_names
from tests import needs

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "compose" / "grafana" / "dashboards" / "omnirelay.json"
PROVISIONING = REPO / "compose" / "grafana" / "provisioning"
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
DOCS = REPO / "docs" / "federation.md"
VARIABLES = ("pipeline", "stage", "replica")

# --- PromQL tokenizer -------------------------------------------------------------------------------
AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "double_exponential_smoothing",
    "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase",
    "info", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time",
    "max_over_time", "min_over_time", "minute", "month", "pi", "predict_linear", "present_over_time",
    "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort",
    "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time",
    "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year", "start", "end",
}  # fmt: skip
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
"""Keywords followed by a parenthesized list of label names."""
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
GRAFANA_FUNCTIONS = {"query_result"}
"""Grafana's templating helpers that wrap a PromQL expression."""

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])
  | (?P<num>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|=~|!~|>=|<=|[-+*/%^<>=@,(){}\[\]])
    """,
    re.X,
)


class PromQLError(ValueError):
    pass


def tokens(expr: str) -> Iterator[tuple[str, str]]:
    """(kind, text) of every token except whitespace; raises on a character PromQL does not have."""
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise PromQLError(f"unexpected {expr[pos : pos + 20]!r} at {pos} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            yield m.lastgroup, m.group()  # type: ignore[misc]


def metric_names(expr: str, extra_functions: frozenset[str] = frozenset()) -> set[str]:
    """Metric names used by a PromQL expression.

    An identifier is a metric name unless it is a function or aggregation (followed by ``(``), a
    keyword, a label name (inside ``{...}`` matchers or the list after by/without/on/ignoring/
    group_left/group_right), or inside a range/subquery ``[...]``. Strings, numbers, durations and
    Grafana variables are skipped. An unknown function name is an error (a misspelled ``rate``
    must not pass as a metric).
    """
    toks = list(tokens(expr))
    names: set[str] = set()
    depth = {"{": 0, "[": 0, "(": 0}
    closing = {"}": "{", "]": "[", ")": "("}
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text in depth:
            depth[text] += 1
        elif text in closing:
            depth[closing[text]] -= 1
            if depth[closing[text]] < 0:
                raise PromQLError(f"unbalanced {text!r} in {expr!r}")
        elif kind == "ident" and not depth["{"] and not depth["["]:
            word = text.lower()
            if word in GROUPING and nxt == "(":
                level, i = 0, i + 1
                while i < len(toks):  # skip the label list
                    level += {"(": 1, ")": -1}.get(toks[i][1], 0)
                    if level == 0:
                        break
                    i += 1
            elif word in KEYWORDS:
                pass
            elif text in AGGREGATIONS and nxt.lower() in ("by", "without"):
                pass  # sum by (...) (...)
            elif nxt == "(":
                if text not in AGGREGATIONS | FUNCTIONS | extra_functions:
                    raise PromQLError(f"unknown function {text!r} in {expr!r}")
            else:
                names.add(text)
        i += 1
    if any(depth.values()):
        raise PromQLError(f"unbalanced parentheses, braces or brackets in {expr!r}")
    return names


def templating_promql(query: str) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query, or None if it has none."""
    q = query.strip()
    if m := re.fullmatch(r"label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)", q, re.S):
        return m[1]
    if re.fullmatch(r"label_values\(\s*[A-Za-z_][A-Za-z0-9_]*\s*\)|label_names\(.*\)|metrics\(.*\)", q, re.S):
        return None
    return q  # query_result(...) or plain PromQL


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable of a dashboard."""
    out = []
    for p in _panels(dashboard["panels"]):
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append((f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            if (promql := templating_promql(q)) is not None:
                out.append((f"variable {v['name']}", promql))
    return out


def grafana_to_promql(expr: str, value: str = ".*", interval: str = "1m") -> str:
    """An expression with Grafana's variables replaced, as Grafana sends it to Prometheus with
    every variable set to All (``.*``)."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", interval, expr)
    return re.sub(r"\$\{?(\w+)(?::\w+)?\}?", value, expr)


# --- what exists --------------------------------------------------------------------------------------
def catalog_names() -> set[str]:
    return {n for f in FAMILIES for n in exposed_names(f)}


def _fresh(base: type, registry: CollectorRegistry) -> type:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **{**kwargs, "registry": registry})

    return type(f"Fresh{base.__name__}", (base,), {"__init__": __init__})


def vllm_stat_logger_names() -> set[str]:
    """Exposed sample names of every family vLLM's PrometheusStatLogger registers for a tiny
    model (plus ``vllm:cache_config_info``, which the engine logs at start), in a fresh registry."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics import loggers
    from vllm.v1.metrics.perf import PerfMetricsProm
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    from libs.models.tiny import resolve_model

    registry = CollectorRegistry()
    gauge, counter, histogram = (_fresh(c, registry) for c in (Gauge, Counter, Histogram))
    slots = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    cls = type(
        "FreshPrometheusStatLogger",
        (loggers.PrometheusStatLogger,),
        {
            **slots,
            "_spec_decoding_cls": type("S", (SpecDecodingProm,), {"_counter_cls": counter}),
            "_kv_connector_cls": type("K", (KVConnectorProm,), dict(slots)),
            "_ec_connector_cls": type("E", (ECConnectorProm,), dict(slots)),
            "_perf_metrics_cls": type("P", (PerfMetricsProm,), {"_counter_cls": counter}),
        },
    )
    model = ModelConfig(
        model=resolve_model("tiny-thinker"), max_model_len=256, enforce_eager=True, dtype="float32"
    )
    config = VllmConfig(model_config=model)
    with pytest.MonkeyPatch.context() as mp:  # leave the process's default registry alone
        mp.setattr(loggers, "unregister_vllm_metrics", lambda: None)
        logger = cls(config, [0])
        logger.log_metrics_info("cache_config", config.cache_config)
    names = set()
    for fam in registry.collect():
        if fam.type == "counter":
            names.add(f"{fam.name}_total")
        elif fam.type == "histogram":
            names |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        else:
            names.add(fam.name)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def known_names() -> set[str]:
    vllm_names = vllm_stat_logger_names()
    assert {"vllm:num_requests_running", "vllm:e2e_request_latency_seconds_bucket"} <= vllm_names
    return catalog_names() | vllm_names | set(engine_process_names())


def unknown_metrics(dashboard: dict[str, Any], known: set[str]) -> list[str]:
    problems = []
    for where, expr in dashboard_queries(dashboard):
        try:
            names = metric_names(
                expr, frozenset(GRAFANA_FUNCTIONS) if where.startswith("variable") else frozenset()
            )
        except PromQLError as e:
            problems.append(f"{where}: {e}")
            continue
        if not names:
            problems.append(f"{where}: no metric in {expr!r}")
        problems += [f"{where}: unknown metric {n!r}" for n in sorted(names - known)]
    return problems


# --- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("vllm:num_requests_running", {"vllm:num_requests_running"}),
        (
            'histogram_quantile(0.99, sum by (pipeline, le) (rate(vllm:omni_e2e_request_latency_s_bucket{pipeline=~"$pipeline"}[$__rate_interval])))',
            {"vllm:omni_e2e_request_latency_s_bucket"},
        ),
        (
            'sum by (threshold_ms) (increase(a_total{x="rate(b)"}[5m])) / on (pipeline) group_left () sum(c_total)',
            {"a_total", "c_total"},
        ),
        ("sum(rate(x_total[1h30m] offset 5m)) without (le) > bool 0.5e3", {"x_total"}),
        ("max(foo @ 1700000000) or vector(0)", {"foo"}),
        ("rate(foo[5m:30s]) and on() (bar{a!~'b'})", {"foo", "bar"}),
        ("count(up == 1) by (job)", {"up"}),
        ("-Inf < nan_metric", {"nan_metric"}),
    ],
)
def test_tokenizer_finds_metric_names_only(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


@pytest.mark.parametrize("expr", ["rat(foo[5m])", "sum(foo{a='b'}", "foo[5m"])
def test_tokenizer_rejects_unknown_functions_and_unbalanced_input(expr: str) -> None:
    with pytest.raises(PromQLError):
        metric_names(expr)


def test_templating_queries_are_unwrapped() -> None:
    assert (
        templating_promql('label_values(vllm:omni_stage_info{a="b"}, stage)') == 'vllm:omni_stage_info{a="b"}'
    )
    assert templating_promql("label_values(pipeline)") is None
    assert metric_names(templating_promql('query_result(x{a=~"$v"})') or "", frozenset({"query_result"})) == {
        "x"
    }


def test_every_dashboard_metric_is_an_exported_family(dashboard, known_names) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 40, "the dashboard lost its panels"
    problems = unknown_metrics(dashboard, known_names)
    assert not problems, "\n".join(problems)


def test_a_misspelled_family_is_caught(dashboard, known_names) -> None:
    broken = copy.deepcopy(dashboard)
    target = next(
        t
        for p in _panels(broken["panels"])
        for t in p.get("targets", [])
        if "vllm:omni_audio_ttfp_s_bucket" in t.get("expr", "")
    )
    target["expr"] = target["expr"].replace("vllm:omni_audio_ttfp_s_bucket", "vllm:omni_audio_tffp_s_bucket")
    var = next(v for v in broken["templating"]["list"] if v["name"] == "replica")
    var["query"] = var["query"].replace("vllm:omni_stage_info", "vllm:omni_stage_infos")
    engine = next(
        t
        for p in _panels(broken["panels"])
        for t in p.get("targets", [])
        if "vllm:kv_cache_usage_perc" in t["expr"]
    )
    engine["expr"] = engine["expr"].replace("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_percent")
    problems = "\n".join(unknown_metrics(broken, known_names))
    for name in ("vllm:omni_audio_tffp_s_bucket", "vllm:omni_stage_infos", "vllm:kv_cache_usage_percent"):
        assert f"unknown metric {name!r}" in problems, problems
    assert not unknown_metrics(dashboard, known_names), "the original must still pass"


def test_dashboard_covers_the_required_families(dashboard) -> None:
    used = set().union(
        *(metric_names(e, frozenset(GRAFANA_FUNCTIONS)) for _, e in dashboard_queries(dashboard))
    )
    required = {
        # vLLM's standard panels, per stage and replica
        "vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
        "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
        # audio SLO
        "vllm:omni_audio_ttfp_s_bucket", "vllm:omni_audio_rtf_bucket", "vllm:omni_audio_underrun_s_bucket",
        "vllm:omni_audio_continuity_ok_total", "vllm:omni_audio_streams_total",
        # transfers and attribution
        "vllm:omni_transfer_size_bytes_sum", "vllm:omni_transfer_tx_s_sum", "vllm:omni_transfer_rx_s_sum",
        "vllm:omni_transfer_in_flight_s_sum", "vllm:omni_e2e_request_latency_s_sum",
        "vllm:omni_stage_request_s_sum",
        # bus lag and pipeline outcomes
        "vllm:omni_bus_consumer_pending", "vllm:omni_num_requests_running", "vllm:omni_num_requests_waiting",
        "vllm:omni_requests_success_total", "vllm:omni_requests_failed_total",
    }  # fmt: skip
    assert not required - used, sorted(required - used)


def test_variables_and_their_use(dashboard) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(VARIABLES) <= variables.keys()
    for name in VARIABLES:
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*", name
    exprs = [e for w, e in dashboard_queries(dashboard) if w.startswith("panel")]
    for name in VARIABLES:
        assert any(f"${name}" in e for e in exprs), f"no panel filters by ${name}"
    assert all('pipeline=~"$pipeline"' in e for e in exprs), "every panel is filtered by pipeline"


def test_panel_structure(dashboard) -> None:
    panels = list(_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p.get("description"), f"{p['title']}: say what it shows"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
    assert dashboard["uid"] == "omnirelay"


def test_docs_list_every_panel_with_its_promql(dashboard) -> None:
    """docs/federation.md shows each panel's title and PromQL as the dashboard has them."""
    docs = DOCS.read_text(encoding="utf-8")
    missing = [
        f"{p['title']!r}: {t['expr']}"
        for p in _panels(dashboard["panels"])
        if p["type"] != "row"
        for t in p["targets"]
        if f"**{p['title']}**" not in docs or f"  {t['expr']}\n" not in docs
    ]
    assert not missing, "\n".join(missing)


def test_grafana_provisioning_matches_compose() -> None:
    """The provider reads the directory compose mounts, the datasource is the compose Prometheus."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "omnirelay.yaml").read_text())["providers"][0]
    dash_dir = provider["options"]["path"]
    assert mounts[dash_dir] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    prom = next(d for d in ds if d["type"] == "prometheus")
    assert prom["url"] == "http://prometheus:9090" and prom["uid"] == "prometheus" and prom["isDefault"]
    assert "prometheus" in compose["services"]


def test_every_expression_parses_with_promtool(dashboard, tmp_path: Path) -> None:
    promtool = needs.program(
        "promtool", "promtool not installed (`make prometheus-bin` installs Debian's prometheus package)"
    )
    rules = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(e)}
        for i, (_, e) in enumerate(dashboard_queries(dashboard))
        if not e.startswith("query_result(")
    ] + [
        {"record": "dashboard:query_result", "expr": grafana_to_promql(e[len("query_result(") : -1])}
        for _, e in dashboard_queries(dashboard)
        if e.startswith("query_result(")
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # ... and promtool does reject a broken expression.
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(x[5m])"}]}]})
    )
    assert (
        subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60).returncode
        != 0
    )
