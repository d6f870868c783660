"""``nats-server`` killed (SIGKILL) while ONE thinker replica streams every request, and started
again on the same store 2 s later. Real gateway, orchestrator and thinker worker on a server of the
test's own. The worker must neither fail a request because a publish could not go out during the
outage (it used to: nats-py's reconnect buffer overflowed, ``OutboundBufferLimitError``, every
request marked failed and the clients left silent until their deadline) nor leave a gap: every
stream completes with exactly the tokens of the same request without a fault, and no client waits
longer than :data:`PAUSE_LIMIT_S`."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest
from openai import AsyncOpenAI

from libs.common.local_nats import free_port
from tests.conftest import NatsServer
from tests.e2e.test_replica_death import Seen, _stream
from tests.procs import THINKER_YAML, gone, start_service, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "bounce"
STREAMS, MAX_TOKENS = 8, 1900
MIDWAY_TOKENS = 50
"""Every stream has at least this many tokens at its client when the broker dies."""
DOWN_S = 2.0
"""How long the broker stays down, seconds."""
PAUSE_LIMIT_S = 5.0
"""Issue 18's bound on the longest pause a client sees, seconds (the outage itself is 2 s)."""


@pytest.fixture
def own_nats(tmp_path):
    server = NatsServer(tmp_path / "jetstream")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bounce_stack(own_nats, tmp_path):
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, THINKER_YAML, timeout_s=120)
    port = free_port()
    procs = [
        start_service(["orchestrator"], own_nats.url, path, tmp_path / "orch.log"),
        start_service(["gateway", "--port", str(port)], own_nats.url, path, tmp_path / "gw.log"),
        start_service(
            ["worker", "--stage", "0", "--replica", "0"],
            own_nats.url,
            path,
            tmp_path / "worker.log",
            {"VLLM_CPU_KVCACHE_SPACE": "1"},
        ),
    ]
    procs[0].wait_log("ready")
    procs[1].wait_log("Uvicorn running")
    procs[2].wait_log(": serving omni.", timeout_s=300)
    yield f"http://127.0.0.1:{port}", procs
    for p in procs:
        p.stop()


async def _reference(client: AsyncOpenAI, model: str) -> list[int]:
    """The greedy tokens of the streams' request without a fault (asked until the stack routes)."""
    seen = Seen()
    for _ in range(60):
        seen = Seen()
        await _stream(client, model, seen)
        if seen.error is None:
            return seen.token_ids
        await asyncio.sleep(0.5)
    raise AssertionError(f"the reference request failed: {seen.error}")


def _longest_pause(seen: Seen, down: float) -> float:
    """The longest wait between two chunks of ``seen`` around the outage (started at ``down``,
    ``time.monotonic()``), seconds."""
    gaps = [b - a for a, b in zip(seen.at, seen.at[1:], strict=False) if b >= down]
    return max(gaps, default=0.0)


async def test_streams_on_one_replica_survive_a_broker_restart(own_nats, bounce_stack) -> None:
    base_url, procs = bounce_stack
    model = f"{PIPELINE}-model"
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    reference = await _reference(client, model)
    assert len(reference) == MAX_TOKENS
    seen = [Seen() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(_stream(client, model, s)) for s in seen]
    deadline = time.monotonic() + 60
    while not all(len(s.token_ids) >= MIDWAY_TOKENS for s in seen):
        assert not any(t.done() for t in tasks), [str(s.error) for s in seen]
        assert time.monotonic() < deadline, [len(s.token_ids) for s in seen]
        await asyncio.sleep(0.02)
    at_kill = [len(s.token_ids) for s in seen]
    pid = own_nats.proc.pid
    own_nats.proc.send_signal(signal.SIGKILL)
    own_nats.proc.wait(5)
    down = time.monotonic()
    assert gone(pid), "nats-server still runs"
    await asyncio.sleep(DOWN_S)
    own_nats.start()  # the same ports, the same store
    await asyncio.wait_for(asyncio.gather(*tasks), 150)
    await client.close()
    pauses = [_longest_pause(s, down) for s in seen]
    print(f"tokens at the kill {at_kill}; longest pauses {[round(p, 2) for p in pauses]} s")
    # The fault hit every stream mid-way: none had all its tokens when the broker died.
    assert all(MIDWAY_TOKENS <= n < MAX_TOKENS for n in at_kill), at_kill
    assert [str(s.error) for s in seen if s.error] == []
    for s in seen:
        assert s.token_ids == reference, (len(s.token_ids), s.id)
        assert s.tokens == MAX_TOKENS and s.finish_reason == "length"
    assert max(pauses) <= PAUSE_LIMIT_S, pauses
    worker_log = procs[2].text()
    assert "OutboundBufferLimitError" not in worker_log
    assert not re.search(r"request \S+ failed", worker_log)
