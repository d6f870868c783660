"""/metrics rendering: both formats keep vllm:* names; OpenMetrics carries exemplars."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from libs.common.metrics_catalog import OMNI_REGISTRY
from libs.common.metrics_server import render, start_metrics_server

PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.fixture(autouse=True)
def family() -> Iterator[Histogram]:
    """A test family in the registry /metrics serves, there only while a test of this module runs
    (registered at import it would show in every scrape of the test process)."""
    h = Histogram(
        "vllm:omni_test_render_s", "test", ["model_name"], registry=OMNI_REGISTRY, buckets=(1.0, 2.0)
    )
    h.labels("m").observe(0.5, {"trace_id": "0af7651916cd43dd8448eb211c80319c"})
    yield h
    OMNI_REGISTRY.unregister(h)


def _samples(families) -> dict[str, object]:
    return {s.name: s for f in families for s in f.samples if s.name.startswith("vllm:omni_test_render")}


def test_openmetrics_keeps_colons_and_carries_the_exemplar() -> None:
    body, ctype = render(PROMETHEUS_2_ACCEPT)
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert "vllm_omni_test_render" not in body.decode()  # no escaping of ':' (prometheus_client 0.26 does)
    buckets = [
        s
        for f in parse_openmetrics(body.decode())
        for s in f.samples
        if s.name == "vllm:omni_test_render_s_bucket"
    ]
    assert [b.exemplar.labels for b in buckets if b.exemplar] == [
        {"trace_id": "0af7651916cd43dd8448eb211c80319c"}
    ]
    assert buckets[0].labels["le"] == "1.0" and buckets[0].exemplar.value == 0.5


def test_text_format_for_other_scrapers() -> None:
    body, ctype = render("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "vllm:omni_test_render_s_count" in _samples(parse_text(body.decode()))
    assert "# {" not in body.decode()


def test_the_http_server_negotiates() -> None:
    port = start_metrics_server(0)
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    assert (
        r.headers["content-type"].startswith("application/openmetrics-text")
        and "vllm:omni_test_render_s_bucket" in r.text
    )
    assert httpx.get(f"http://127.0.0.1:{port}/nope").status_code == 404


def _outward_address() -> str:
    """This machine's address on its default route (no packet is sent: UDP connect only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("203.0.113.1", 9))
        return s.getsockname()[0]


def test_metrics_bind_loopback_unless_told_otherwise() -> None:
    outward = _outward_address()
    if ipaddress.ip_address(outward).is_loopback:
        pytest.skip("no address but loopback here")
    port = start_metrics_server(0)
    assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{outward}:{port}/metrics")
    wide = start_metrics_server(0, "0.0.0.0")
    assert httpx.get(f"http://{outward}:{wide}/metrics").status_code == 200
