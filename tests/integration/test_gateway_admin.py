"""The gateway's operator surfaces are off its public port (issue 22, item 2): ``/metrics`` and
``/prometheus/targets`` answer 404 there, with a valid key or none, and are served on the admin
listener, with no key, bound to 127.0.0.1 by default, where the gateway's registry record points.
A real gateway process with API keys and a real nats-server; no stage runs (none is needed)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import nats
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.bus import bucket_keys, services_kv
from libs.common.registry import ServiceRecord
from libs.common.subjects import SERVICES_BUCKET
from libs.stack.processes import until
from tests.metrics_scrape import scrape, total
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, ServiceProcess, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "admin"
KEY = "sk-admin-test-key"
OPERATOR_PATHS = ("/metrics", "/prometheus/targets")


@dataclass
class Gateway:
    public: str
    proc: ServiceProcess


@pytest.fixture(scope="module")
def gateway(nats_server, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("admin")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML)
    services = Services(nats_server.url, path, tmp).start(
        orchestrators=0, gateway_env={"OMNIRELAY_API_KEYS": KEY}
    )
    with services.serving():  # its stop checks that the gateway ended cleanly
        yield Gateway(services.base_url, services.gateway)


def outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent: UDP connect only), or None
    when it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.parametrize("path", OPERATOR_PATHS)
@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "valid-key"])
def test_the_public_port_does_not_serve_operator_paths(gateway: Gateway, path: str, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{gateway.public}{path}", headers=headers, timeout=10)
    assert r.status_code == 404, r.text
    assert "vllm:" not in r.text and "targets" not in r.text
    # The key is a real one: the same request reaches the API.
    assert httpx.get(f"{gateway.public}/v1/models", headers=headers, timeout=10).status_code == (
        200 if key else 401
    )


def test_the_admin_port_serves_metrics_without_a_key(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.public}/health", timeout=10).status_code in (200, 503)
    assert httpx.get(f"{gateway.public}/v1/models", timeout=10).status_code == 401
    samples = scrape(gateway.proc.metrics_url)
    # The public app's http_* families (the Instrumentator's), counted there, exposed here.
    assert total(samples, "http_requests_total", handler="/health") >= 1, sorted(samples)[:20]
    assert total(samples, "http_requests_total", handler="/v1/models", status="4xx") >= 1
    # The gateway's own families (--log-stats is on; no request yet, so declared without samples)
    # and the process's.
    text = httpx.get(gateway.proc.metrics_url, timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"vllm:omni_num_requests_running", "vllm:omni_requests_success"} <= families, sorted(families)
    assert "process_cpu_seconds" in families
    assert httpx.get(f"{gateway.proc.admin_url}/v1/models", timeout=10).status_code == 404


async def test_the_registry_record_points_at_the_admin_listener(gateway: Gateway, nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await services_kv(nc.jetstream())

        async def gateway_record() -> ServiceRecord | None:
            for key in await bucket_keys(nc, SERVICES_BUCKET):
                if key.startswith(f"gateway.{PIPELINE}."):
                    return ServiceRecord.model_validate_json((await kv.get(key)).value)
            return None

        rec = await until(gateway_record, "the gateway's registry record")
    finally:
        await nc.close()
    assert rec.metrics_url == gateway.proc.metrics_url
    groups = httpx.get(f"{gateway.proc.admin_url}/prometheus/targets", timeout=10).json()
    (own,) = [g for g in groups if g["labels"]["__meta_omnirelay_instance"] == rec.instance]
    assert own["targets"] == [urlsplit(gateway.proc.metrics_url).netloc]
    assert own["labels"]["__metrics_path__"] == "/metrics"
    assert own["labels"]["__meta_omnirelay_service"] == "gateway"


def test_the_admin_port_binds_loopback_by_default(gateway: Gateway) -> None:
    admin_port = urlsplit(gateway.proc.metrics_url).port
    public_port = urlsplit(gateway.public).port
    assert gateway.proc.proc is not None
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(gateway.proc.proc.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening == {("127.0.0.1", public_port), ("127.0.0.1", admin_port)}, listening
    if (outward := outward_address()) is not None:  # a machine with only loopback has nothing to refuse
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{outward}:{admin_port}/metrics", timeout=5)
