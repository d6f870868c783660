"""compose/ started natively: a real ``nats-server`` plus every omnirelay service of the compose file
started as ``python -m cli <command>`` with that service's compose environment (NATS address,
pipeline path, hosts and ports swapped for local ones); the gateway must become healthy, the
compose healthcheck commands must pass against the processes, and a text+audio chat request must
return audio. Each command runs once in a Python of its own, as a container runs it (``FRESH``);
the other workers are forked, as ``omnirelay up`` forks its services."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest
import yaml

from libs.common.pipeline import load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL, free_port
from libs.stack.local_stack import Stack, http_status
from libs.stack.nats_security import prepare
from tests.compose_files import (
    CHAT_TIMEOUT_S,
    COMPOSE_FILE,
    COMPOSE_NATS_URL,
    DEFAULT_PIPELINE,
    HEALTHCHECK_SCRIPT,
    HEALTHY_TIMEOUT_S,
    IMAGE_HEALTHCHECK,
    IMAGE_PIPELINES_DIR,
    NATS_SECRETS_MOUNT,
    PIPELINES_DIR,
    REPO,
    as_env,
    load_compose,
    omnirelay_services,
)
from tests.procs import session_forker

pytestmark = pytest.mark.integration

FRESH = {"gateway", "orchestrator", "thinker-0"}
"""The services started as a Python of their own: one of each command (``gateway``,
``orchestrator``, ``worker`` with a vLLM engine). The other workers run the same ``python -m cli
worker`` forked from the session's forker: five fresh workers would import torch and vLLM five
times (~12 s of a core each) on the two cores."""


# --- 3. native start -----------------------------------------------------------------------------
@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Processes stopped like ``docker compose down``: the gateway first, then the services it
    fronts, NATS last (so it outlives the services that drain into it)."""
    services = Stack(tmp_path, log_dir=tmp_path)
    try:
        yield services
    finally:
        services.stop()


def _local_env(
    name: str, compose_env: Mapping[str, str], nats_url: str, data: Path, secrets: Path
) -> dict[str, str]:
    """A compose service's environment for a process on this machine: the documented substitutions
    (NATS address, pipeline path, hosts, ports, the gateway's data volume as ``data``, the service's
    NATS identity volume as its directory under ``secrets``) and nothing else."""
    env = dict(compose_env)
    for var in ("OMNIRELAY_NATS_PASSWORD_FILE", "OMNIRELAY_NATS_CA"):
        mounted = Path(env[var]).relative_to(NATS_SECRETS_MOUNT)
        env[var] = str(secrets / env["OMNIRELAY_NATS_USER"] / mounted)
    assert env.pop("NATS_URL") == COMPOSE_NATS_URL
    env["NATS_URL"] = nats_url
    image_path = Path(env["OMNIRELAY_PIPELINE"])
    env["OMNIRELAY_PIPELINE"] = str(PIPELINES_DIR / image_path.relative_to(IMAGE_PIPELINES_DIR))
    assert env["OMNIRELAY_ADVERTISE_HOST"] == name
    env["OMNIRELAY_ADVERTISE_HOST"] = "127.0.0.1"
    for var in ("OMNIRELAY_HOST", "OMNIRELAY_METRICS_HOST"):
        if var in env:
            env[var] = "127.0.0.1"
    if "OMNIRELAY_API_KEYS_FILE" in env:
        env["OMNIRELAY_API_KEYS_FILE"] = str(data / Path(env["OMNIRELAY_API_KEYS_FILE"]).relative_to("/data"))
    for var in ("OMNIRELAY_PORT", "OMNIRELAY_ADMIN_PORT", "OMNIRELAY_METRICS_PORT"):
        if var in env:
            env[var] = str(free_port())
    assert env.pop("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://otel-collector:4317"
    env.pop("OTEL_EXPORTER_OTLP_PROTOCOL")  # no collector here: tracing stays off
    return env


def _healthcheck_argv(test: list[str]) -> list[str]:
    """A compose healthcheck ``CMD`` as a local command: this Python, the repository's script."""
    assert test[0] == "CMD", test
    argv = test[1:]
    return [
        sys.executable if a == "python" else str(HEALTHCHECK_SCRIPT) if a == IMAGE_HEALTHCHECK else a
        for a in argv
    ]


def test_healthcheck_script_fails_on_a_closed_port() -> None:
    env = {**os.environ, "OMNIRELAY_METRICS_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT), "metrics"], env=env, capture_output=True, timeout=30
    )
    assert done.returncode == 1, done
    assert b"/metrics" in done.stdout


@pytest.mark.timeout(600)
def test_compose_services_start_natively_and_serve_audio(
    stack: Stack, tmp_path: Path, record_property
) -> None:
    from libs.models.tiny import make_tiny

    make_tiny()  # once, before the workers race for it (it is lock-safe, this only saves time)
    pipeline = load_pipeline(DEFAULT_PIPELINE)
    services = omnirelay_services(load_compose(COMPOSE_FILE))
    assert set(services) >= FRESH, sorted(services)

    # NATS as the launcher starts it, on free loopback ports, with nats-init's identities and TLS.
    secrets = prepare(tmp_path / "nats-secrets", pipeline, tls=True)
    nats_url = stack.start_nats(1, SYNC_INTERVAL, secrets.server_conf)

    # Every omnirelay service of the compose file, with its compose environment, on a clean base env.
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "NATS_URL" and (not k.startswith("OMNIRELAY_") or k == "OMNIRELAY_CACHE_DIR")
    }
    base |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    envs: dict[str, dict[str, str]] = {}
    t0 = time.monotonic()
    for name, svc in services.items():
        envs[name] = _local_env(
            name, as_env(svc["environment"]), nats_url, tmp_path / "gateway-data", secrets.root
        )
        argv = [sys.executable, "-m", "cli", *svc["command"]]
        if name in FRESH:
            stack.spawn(name, argv, base | envs[name], cwd=REPO, inherit_env=False)
        else:
            stack.spawn(name, argv, base | envs[name], inherit_env=False, forker=session_forker())

    gateway = f"http://127.0.0.1:{envs['gateway']['OMNIRELAY_PORT']}"
    stack.wait(lambda: http_status(f"{gateway}/health") == 200, "the gateway healthy", HEALTHY_TIMEOUT_S)
    gateway_s = time.monotonic() - t0
    health = httpx.get(f"{gateway}/health", timeout=5).json()
    assert health["orchestrators"] >= 1 and all(n >= 1 for n in health["stages"].values()), health

    # Every compose healthcheck command passes against its process (`docker compose up --wait`):
    # the gateway is healthy with one replica per stage, the other replicas may still be loading.
    pending = dict(services)
    while pending:
        for name, svc in list(pending.items()):
            argv = _healthcheck_argv(svc["healthcheck"]["test"])
            done = subprocess.run(argv, env=base | envs[name], capture_output=True, timeout=30)
            if done.returncode == 0:
                del pending[name]
        assert not stack.dead(), f"exited during start: {stack.dead()}"
        if pending and time.monotonic() - t0 > HEALTHY_TIMEOUT_S:
            pytest.fail(f"healthchecks still failing after {HEALTHY_TIMEOUT_S:.0f} s: {sorted(pending)}")
        time.sleep(1 if pending else 0)
    all_s = time.monotonic() - t0
    live = httpx.get(f"{gateway}/health", timeout=5).json()["stages"]
    assert live == {f"{i}:{s.name}": s.replicas for i, s in enumerate(pipeline.stages)}, live
    record_property("seconds_to_gateway_healthy", round(gateway_s, 1))
    record_property("seconds_to_all_healthy", round(all_s, 1))
    print(
        f"\ngateway healthy {gateway_s:.1f} s, all {len(services)} services healthy {all_s:.1f} s after start"
    )

    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "modalities": ["text", "audio"],
        "max_tokens": 8,
    }
    # The gateway generated its API key into its data volume at first start and requires it.
    assert httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=10).status_code == 401
    key_file = Path(envs["gateway"]["OMNIRELAY_API_KEYS_FILE"])
    (key,) = [ln for ln in key_file.read_text().splitlines() if not ln.startswith("#")]
    auth = {"Authorization": f"Bearer {key}"}
    t1 = time.monotonic()
    resp = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=auth, timeout=CHAT_TIMEOUT_S)
    chat_s = time.monotonic() - t1
    record_property("seconds_chat_text_audio", round(chat_s, 2))
    print(f"text+audio chat request: HTTP {resp.status_code} in {chat_s:.2f} s")
    assert resp.status_code == 200, f"{resp.status_code} {resp.text}"
    message = resp.json()["choices"][0]["message"]
    data = (message.get("audio") or {}).get("data")
    assert data, f"no audio in {message}"
    wav = base64.b64decode(data)
    assert wav[:4] == b"RIFF" and len(wav) > 44, f"not a WAV with samples: {len(wav)} bytes"
    assert not stack.dead(), stack.dead()
    _assert_log_stats_off_exports_no_vllm_family(gateway, envs, record_property)


def _assert_log_stats_off_exports_no_vllm_family(
    gateway: str, envs: dict[str, dict[str, str]], record_property
) -> None:
    """Gating: the compose default (--log-stats off) registers no vllm:* family in any service —
    neither omnirelay's vllm:omni_* nor the engines' — after real traffic went through."""
    assert httpx.get(f"{gateway}/metrics", timeout=10).status_code == 404, "not on the public port"
    urls = {"gateway": f"http://127.0.0.1:{envs['gateway']['OMNIRELAY_ADMIN_PORT']}/metrics"}
    urls |= {
        name: f"http://127.0.0.1:{env['OMNIRELAY_METRICS_PORT']}/metrics"
        for name, env in envs.items()
        if "OMNIRELAY_METRICS_PORT" in env
    }
    assert len(urls) == len(envs), sorted(envs)
    for name, url in urls.items():
        lines = httpx.get(url, timeout=10).text.splitlines()
        vllm = [ln for ln in lines if "vllm:" in ln]
        assert not vllm, f"{name} exports vllm families with --log-stats off: {vllm[:5]}"
        assert any(ln.startswith("process_") for ln in lines), name
        record_property(f"metrics_lines_log_stats_off_{name}", len(lines))


def test_tracing_config_wires_services_to_the_collector_and_the_collector_to_jaeger() -> None:
    """The files only: no span is sent, and ``make compose-check`` looks for none in Jaeger either
    (where no registry answers, the collector and Jaeger have no stand-in image). Every omnirelay
    service's OTLP endpoint is the collector, the collector's traces pipeline uses only receivers,
    processors and exporters it declares and exports to a compose service, and Grafana's
    Prometheus data source links an exemplar's ``trace_id`` to its Jaeger data source."""
    compose = load_compose(COMPOSE_FILE)
    services = compose["services"]
    for name, svc in omnirelay_services(compose).items():
        env = as_env(svc["environment"])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
    collector = yaml.safe_load((COMPOSE_FILE.parent / "otel-collector.yaml").read_text())
    traces = collector["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(traces[kind]) <= set(collector[kind]), kind
    jaeger_exporter = collector["exporters"][traces["exporters"][0]]["endpoint"]
    assert jaeger_exporter.split(":")[0] in services and "otel-collector" in services
    grafana = COMPOSE_FILE.parent / "grafana" / "provisioning" / "datasources"
    jaeger = yaml.safe_load((grafana / "jaeger.yaml").read_text())["datasources"][0]
    prom = yaml.safe_load((grafana / "prometheus.yaml").read_text())["datasources"][0]
    (link,) = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert (link["name"], link["datasourceUid"]) == ("trace_id", jaeger["uid"])  # the exemplar label we emit
    assert jaeger["url"].startswith("http://jaeger:")
