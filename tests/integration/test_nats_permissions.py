"""The NATS identities as shipped: ``omnirelay up`` (text-only pipeline, its thinker on the mock
engine: the bus plumbing is the same) starts its nats-server with the configuration it generates
(libs/stack/nats_security.py) and gives each service its identity; the attacks below run against that server with the secrets ``up`` wrote, and
a real request goes through the stack they protect.

Every refusal is shown two ways: the server's permissions violation reaches the client's error
callback, and what the refused action would have done did not happen (checked with an identity that
may see it, after a control message that was allowed has arrived).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
import yaml
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig

from cli.stack_file import StackInfo, read_live_stack
from libs.common.bus import bucket_keys, connect, ensure_topology, server_urls
from libs.common.nats_credentials import auth_from
from libs.common.pipeline import load_pipeline
from libs.common.subjects import SERVICES_BUCKET, Subjects
from libs.stack.bus_state import barrier
from libs.stack.local_nats import free_port, nats_server_argv
from libs.stack.local_stack import Stack
from libs.stack.nats_security import SECRETS_DIR, NatsSecurity, prepare
from libs.stack.nats_tls import ensure_ca
from libs.stack.processes import until, wait_for
from tests.client_streams import ended, until_record
from tests.conftest import wait_port
from tests.procs import stop_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420.0
WAIT_S = 10.0


@dataclass
class Up:
    info: StackInfo
    data_dir: Path
    base_url: str

    def env(self, identity: str) -> dict[str, str]:
        d = self.data_dir / SECRETS_DIR / identity
        return {"OMNIRELAY_NATS_USER": identity, "OMNIRELAY_NATS_PASSWORD_FILE": str(d / "password")}


def _on_the_mock_engine(path: Path) -> Path:
    """compose/pipelines/text-only.yaml with its thinker on the mock engine (docs/pipeline.md):
    the same pipeline name, stages and replicas, so the same identities and permissions, and the
    same bus traffic per request; no vLLM engine starting beside the attacks (it took ~40 s of
    both cores)."""
    doc = yaml.safe_load((REPO / "compose/pipelines/text-only.yaml").read_text())
    doc["stages"][0]["engine"] = {"mock": {"inter_token_ms": 0}}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    data_dir = tmp_path_factory.mktemp("up")
    log = data_dir / "up.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OMNIRELAY_NATS_"))}
    env |= {"OMNIRELAY_PIPELINE": str(_on_the_mock_engine(data_dir / "text-only-mock.yaml"))}
    argv = [sys.executable, "-m", "cli", "up", "--port", str(port), "--data-dir", str(data_dir)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def live() -> StackInfo | None:
            info = read_live_stack(data_dir)
            if info is None and proc.poll() is not None:
                raise RuntimeError("up exited")
            return info

        try:
            info = wait_for(live, "up's live stack", START_TIMEOUT_S, every_s=1)
        except RuntimeError as e:
            raise RuntimeError(
                f"up did not come up ({e}; exit {proc.poll()}):\n{log.read_text()[-5000:]}"
            ) from None
        yield Up(info, data_dir, f"http://127.0.0.1:{port}")
    finally:
        stop_process(proc, signal.SIGINT, 60)


class Client:
    """A connection as one identity, keeping the errors the server sent it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: NATS | None = None

    async def connect(self, url: str, env: dict[str, str] | None) -> NATS:
        async def remember(e: Exception) -> None:
            self.errors.append(str(e).lower())

        options = auth_from(env).connect_options() if env else {}
        self.nc = await nats.connect(url, error_cb=remember, allow_reconnect=False, **options)
        return self.nc

    async def violation(self, subject: str) -> None:
        """Wait until the server has reported a permissions violation naming ``subject``."""
        await until(
            lambda: any("permissions violation" in e and subject.lower() in e for e in self.errors),
            f"a permissions violation for {subject}",
            WAIT_S,
        )


async def _as(up: Up, identity: str) -> Client:
    c = Client()
    await c.connect(up.info.nats_url, up.env(identity))
    return c


async def _received(sub, want: int, *clients: Client) -> list[bytes]:
    """The payloads ``sub`` received once it has ``want`` of them (fails after WAIT_S, naming the
    errors the server sent ``clients``)."""
    try:
        await until(lambda: sub.pending_msgs >= want, f"{sub.subject}: {want} messages", WAIT_S)
    except AssertionError as e:
        raise AssertionError(f"{e}; the server's errors: {[c.errors for c in clients]}") from None
    return [(await sub.next_msg(timeout=1)).data for _ in range(sub.pending_msgs)]


async def test_an_anonymous_client_or_a_wrong_password_is_refused(up: Up) -> None:
    for env in (None, {"OMNIRELAY_NATS_USER": "gateway", "OMNIRELAY_NATS_PASSWORD": "guess"}):
        c = Client()
        with pytest.raises(NatsError):
            await c.connect(up.info.nats_url, env)
        assert any("authorization violation" in e for e in c.errors), c.errors


async def test_a_worker_cannot_read_answers_cancel_requests_or_forge_a_registry_key(up: Up) -> None:
    worker, orchestrator, gateway = (
        await _as(up, "worker-0-0"),
        await _as(up, "orchestrator"),
        await _as(up, "gateway"),
    )
    other_worker = await _as(up, "worker-0-0")
    try:
        # Read every user's answers: the subscription is refused, the gateway's copy arrives, the worker's never.
        stolen = await worker.nc.subscribe("omni.text.out.>")
        await worker.violation("omni.text.out.>")
        control = await gateway.nc.subscribe("omni.text.out.gw1.*")
        await barrier(gateway.nc)
        await orchestrator.nc.publish("omni.text.out.gw1.req1", b"an answer")
        await barrier(orchestrator.nc)  # the server has the answer: a miss below is the delivery's
        assert await _received(control, 1, gateway, orchestrator) == [b"an answer"]
        await barrier(worker.nc)
        assert stolen.pending_msgs == 0

        # Cancel requests: the forged abort is refused, the orchestrator's arrives alone.
        aborts = await other_worker.nc.subscribe("omni.text.ctl.abort")
        await barrier(other_worker.nc)
        await worker.nc.publish("omni.text.ctl.abort", b"forged")
        await barrier(worker.nc)
        await worker.violation("omni.text.ctl.abort")
        await orchestrator.nc.publish("omni.text.ctl.abort", b"control")
        await barrier(orchestrator.nc)
        assert await _received(aborts, 1, other_worker, orchestrator) == [b"control"]

        # Registry: another replica's key (undeclared, the attack's low-load decoy) is refused and not
        # written; its own key it may write (the live worker's record, written back as it is).
        kv = await worker.nc.jetstream(timeout=2).key_value("omni_services")
        with pytest.raises(NatsTimeout):
            await kv.put("worker.text.0.7", b'{"load": 0}')
        await worker.violation("$kv.omni_services.worker.text.0.7")
        with pytest.raises(NatsTimeout):
            await kv.put("gateway.text.decoy", b"{}")
        seen = await gateway.nc.jetstream().key_value("omni_services")  # a worker reads no registry
        own = await seen.get("worker.text.0.0")
        assert (await kv.put("worker.text.0.0", own.value)) > own.revision
        keys = await bucket_keys(gateway.nc, SERVICES_BUCKET)
        assert "worker.text.0.7" not in keys and "gateway.text.decoy" not in keys
    finally:
        for c in (worker, orchestrator, gateway, other_worker):
            await c.nc.close()


async def test_the_operator_reads_the_bus_and_publishes_nothing(up: Up) -> None:
    operator = await _as(up, "operator")
    gateway = await _as(up, "gateway")
    try:
        js = operator.nc.jetstream(timeout=3)
        names = {s.config.name for s in await js.streams_info()}
        assert {"OMNI_TEXT_REQUESTS", "OMNI_TEXT_STAGES", "OMNI_TEXT_EVENTS", "KV_omni_services"} <= names
        kv = await js.key_value("omni_services")
        record = json.loads((await kv.get("worker.text.0.0")).value)
        assert (record["stage"], record["replica"]) == (0, 0)
        with pytest.raises(NatsTimeout):
            await js.publish("omni.text.requests", b"an admission")
        await operator.violation("omni.text.requests")
        with pytest.raises(NatsTimeout):
            await kv.put("worker.text.0.0", b"{}")
        await operator.violation("$kv.omni_services.worker.text.0.0")
        await operator.nc.subscribe("omni.text.out.>")
        await operator.violation("omni.text.out.>")
        # Nothing was admitted: the requests stream holds no message from the operator.
        assert (await gateway.nc.jetstream().stream_info("OMNI_TEXT_REQUESTS")).state.messages == 0
    finally:
        await operator.nc.close()
        await gateway.nc.close()


def test_inspect_finds_the_stack_and_reads_it_as_the_operator(up: Up, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OMNIRELAY_"))}
    r = subprocess.run(
        [sys.executable, "-m", "cli", "inspect", "--json", "--data-dir", str(up.data_dir)],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert [
        (s["service"], s["stage"], s["replica"]) for s in snap["services"] if s["service"] == "worker"
    ] == [("worker", 0, 0)]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, int, NatsSecurity]]:
    """A nats-server with the identities and mutual TLS (``prepare(tls=True, mutual_tls=True)``)."""
    sec = prepare(tmp_path / "secrets", load_pipeline(REPO / "compose/pipelines/text-only.yaml"), True, True)
    port, monitor = free_port(), free_port()
    (tmp_path / "js").mkdir()
    argv = nats_server_argv(tmp_path / "js", port, monitor, None, sec.server_conf)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_port(port)
        yield f"nats://127.0.0.1:{port}", monitor, sec
    finally:
        stop_process(proc, signal.SIGTERM, 10)


async def test_tls_the_server_is_verified_and_a_client_certificate_required(tls_server, tmp_path) -> None:
    url, monitor, sec = tls_server
    nc = await connect(url, "tls-test", sec.credentials("gateway"))
    # The server's own account of the connection (its monitoring endpoint): TLS, as gateway.
    connz = httpx.get(f"http://127.0.0.1:{monitor}/connz?auth=1", timeout=5).json()
    [conn] = [c for c in connz["connections"] if c.get("name") == "tls-test"]
    assert conn["tls_version"].startswith("1.") and conn["authorized_user"] == "gateway"
    await nc.close()

    # Without TLS, or trusting another CA (a server that is not ours), or without the client certificate.
    other_ca = ensure_ca(tmp_path / "other-ca")
    env = sec.env("gateway")
    for changed in (
        {
            k: v
            for k, v in env.items()
            if k not in ("OMNIRELAY_NATS_CA", "OMNIRELAY_NATS_CERT", "OMNIRELAY_NATS_KEY")
        },
        {**env, "OMNIRELAY_NATS_CA": str(other_ca.cert)},
        {k: v for k, v in env.items() if k not in ("OMNIRELAY_NATS_CERT", "OMNIRELAY_NATS_KEY")},
    ):
        c = Client()
        with pytest.raises((NatsError, OSError)):
            await c.connect(url, changed)


async def test_a_bucket_consumer_delivers_only_where_its_creator_may_listen(tls_server) -> None:
    """The operator may create consumers on the buckets' streams (nats kv ls, watches); one pushed
    onto a subject it may not subscribe (a client's answers, a stage's queue) delivers nothing there,
    one onto its own inbox delivers the record (the control)."""
    url, _, sec = tls_server
    orchestrator = await connect(url, "orchestrator", sec.credentials("orchestrator"))
    operator = await connect(url, "operator", sec.credentials("operator"))
    gateway = await connect(url, "gateway", sec.credentials("gateway"))
    try:
        js = orchestrator.jetstream()
        await ensure_topology(js, Subjects("text"))
        await (await js.key_value("omni_services")).put("orchestrator.text.x", b"{}")
        answers = await gateway.subscribe("omni.text.out.>")
        own = await operator.subscribe("_INBOX.operator.probe")
        await barrier(gateway)
        await barrier(operator)
        ops = operator.jetstream(timeout=3)
        for target in ("omni.text.out.gw1.req1", "omni.text.stage.0.0.in", "_INBOX.operator.probe"):
            await ops.add_consumer("KV_omni_services", ConsumerConfig(deliver_subject=target))
        assert await _received(own, 1) == [b"{}"]
        await barrier(gateway)
        assert answers.pending_msgs == 0
        assert (await js.stream_info("OMNI_TEXT_STAGES")).state.messages == 0
    finally:
        for nc in (orchestrator, operator, gateway):
            await nc.close()


def test_a_request_goes_through_the_stack_of_identities(up: Up) -> None:
    body = {"model": "omni-text", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    r = httpx.post(f"{up.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    # the worker's ending lifecycle event reached the orchestrator, which folded it into the record
    # (each through its own identity's permissions)
    assert asyncio.run(_final_status(up, r.json()["id"])) == "completed"


async def _final_status(up: Up, request_id: str) -> str:
    """The status of the request's record once it is terminal, read as the operator."""
    operator = await _as(up, "operator")
    try:
        kv = await operator.nc.jetstream(timeout=3).key_value("omni_requests")
        return (await until_record(kv, request_id, ended, "ended", WAIT_S)).status.value
    finally:
        await operator.nc.close()


@pytest.mark.parametrize("nodes", [1, 3])
async def test_the_launchers_nats_with_identities_forms_its_cluster(nodes: int, tmp_path: Path) -> None:
    """``omnirelay up``'s servers (``Stack.start_nats``) with the identities: the routes
    authenticate (the cluster elects leaders and replicates a stream on every node), clients must."""
    sec = prepare(tmp_path / "secrets", load_pipeline(REPO / "compose/pipelines/text-only.yaml"))
    stack = Stack(tmp_path)
    try:
        urls = await asyncio.to_thread(stack.start_nats, nodes, "always", sec.server_conf, sec.route_password)
        nc = await connect(urls, "launcher-test", sec.credentials("orchestrator"))
        await ensure_topology(nc.jetstream(), Subjects("text"))
        assert (await nc.jetstream().stream_info("OMNI_TEXT_STAGES")).config.num_replicas == nodes
        await nc.close()
        c = Client()
        with pytest.raises(NatsError):
            await c.connect(server_urls(urls)[0], None)
        assert any("authorization violation" in e for e in c.errors), c.errors
    finally:
        await asyncio.to_thread(stack.stop)
