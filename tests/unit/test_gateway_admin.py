"""The gateway's admin listener (services/gateway/admin.py) and its wiring: real sockets on
127.0.0.1, the public app without the operator paths, the settings, the launcher's plan and
stack file. The whole gateway process: tests/integration/test_gateway_admin.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cli.launcher import announce, banner, plan_services
from cli.main import app as cli_app
from cli.stack_file import read_live_stack
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, load_pipeline
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.settings import GatewaySettings
from services.gateway import admin as admin_module
from services.gateway.admin import TARGETS_PATH, AdminListener
from services.gateway.app import create_app
from services.gateway.discovery import sd_targets

KEY = "sk-unit-admin"
RECORD = ServiceRecord(
    service=ServiceKind.WORKER,
    pipeline="p",
    instance="host-1-abc",
    stage=0,
    stage_name="thinker",
    replica=1,
    metrics_url="http://10.0.0.7:9100/metrics",
    version="test",
)


async def get(url: str, **kw) -> httpx.Response:
    """A GET from another thread: the listener's targets route needs this event loop free."""
    return await asyncio.to_thread(httpx.get, url, timeout=10, **kw)


async def test_targets_come_from_the_event_loop_and_metrics_need_no_key() -> None:
    admin = AdminListener("127.0.0.1", 0)
    base = f"http://127.0.0.1:{admin.port}"
    try:
        r = await get(f"{base}{TARGETS_PATH}")
        assert r.status_code == 503, "no registry view yet"
        assert r.json()["error"]["type"] == "service_unavailable"

        loop_thread, called_on = threading.get_ident(), []

        def targets() -> list[dict[str, object]]:
            called_on.append(threading.get_ident())
            return sd_targets([RECORD])

        admin.discover(targets)
        r = await get(f"{base}{TARGETS_PATH}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == json.loads(json.dumps(sd_targets([RECORD])))
        assert r.json()[0]["targets"] == ["10.0.0.7:9100"]
        assert called_on == [loop_thread], "the registry view is read on its own loop only"

        m = await get(f"{base}/metrics")
        assert m.status_code == 200 and "process_cpu_seconds_total" in m.text
        assert (await get(f"{base}/v1/models")).status_code == 404
    finally:
        await admin.close()
    with pytest.raises(httpx.ConnectError):
        await get(f"{base}/metrics")


async def test_a_busy_event_loop_is_a_503_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_module, "SNAPSHOT_TIMEOUT_S", 0.2)
    admin = AdminListener("127.0.0.1", 0)
    admin.discover(lambda: sd_targets([RECORD]))
    try:
        t0 = time.monotonic()
        # Called on the loop's own thread: the loop cannot take the snapshot until this returns.
        r = httpx.get(f"http://127.0.0.1:{admin.port}{TARGETS_PATH}", timeout=10)
        assert r.status_code == 503 and "TimeoutError" in r.json()["error"]["message"]
        assert 0.2 <= time.monotonic() - t0 < 5
        r = await get(f"http://127.0.0.1:{admin.port}{TARGETS_PATH}")
        assert r.status_code == 200, "a free loop answers again"
    finally:
        await admin.close()


@pytest.mark.parametrize("path", ["/metrics", TARGETS_PATH])
@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "valid-key"])
async def test_the_public_app_has_no_operator_paths(path: str, key: str | None) -> None:
    app = create_app(GatewaySettings(api_keys=KEY), load_pipeline())
    assert path not in {getattr(r, "path", None) for r in app.routes}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        r = await http.get(path, headers=headers)
    assert r.status_code == 404, r.text


def test_settings_default_to_loopback_and_a_port_of_their_own() -> None:
    s = GatewaySettings()
    assert (s.metrics_host, s.admin_port, s.port) == ("127.0.0.1", 8001, 8000)
    with pytest.raises(ValueError, match="admin port must differ"):
        GatewaySettings(port=9000, admin_port=9000)
    assert GatewaySettings(port=0, admin_port=0).admin_port == 0, "two free ports are two ports"


def test_up_refuses_one_port_for_both() -> None:
    r = CliRunner().invoke(cli_app, ["up", "--port", "8123", "--admin-port", "8123"])
    assert r.exit_code == 2 and "--admin-port must differ" in r.output


def test_the_plan_gives_the_gateway_its_admin_port() -> None:
    p = load_pipeline()
    specs = {s.name: s for s in plan_services(p, DEFAULT_PIPELINE_PATH, "nats://n:1", 8123, False, 8124)}
    assert specs["gateway"].env["OMNIRELAY_ADMIN_PORT"] == "8124"
    assert specs["gateway"].env["OMNIRELAY_PORT"] == "8123"
    default = plan_services(p, DEFAULT_PIPELINE_PATH, "nats://n:1", 8123, False)
    assert [s.env["OMNIRELAY_ADMIN_PORT"] for s in default if s.name == "gateway"] == ["0"]
    assert all("OMNIRELAY_ADMIN_PORT" not in s.env for s in default if s.name != "gateway")


def test_the_stack_file_and_banner_name_the_admin_url(tmp_path: Path) -> None:
    announce(tmp_path, 8123, "nats://127.0.0.1:4999", None, "p", tmp_path / "p.yaml", None, 8124)
    info = read_live_stack(tmp_path)
    assert info is not None
    assert (info.gateway_url, info.gateway_admin_url) == ("http://127.0.0.1:8123", "http://127.0.0.1:8124")
    text = banner(8123, "nats://127.0.0.1:4999", None, "m", 8124)
    assert "http://127.0.0.1:8124/metrics" in text and "http://127.0.0.1:8123/metrics" not in text
