"""``nats-server`` killed with SIGKILL while requests stream and started again on the same store
2 s later: every service reconnects, no replica is judged dead (the orchestrators' probes meet
"no responders" while workers are still reconnecting), and every stream completes."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from libs.common.bus_state import snapshot
from tests.e2e.test_replica_death import MAX_TOKENS, Seen, _stream
from tests.metrics_scrape import delta, scrape
from tests.procs import gone

pytestmark = pytest.mark.e2e

STREAMS = 4


async def test_streams_survive_a_broker_restart(stack, pipeline, nats_server) -> None:
    from openai import AsyncOpenAI

    services = (await snapshot(stack.nats_url, pipeline))["services"]
    orchestrators = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    assert len(orchestrators) == 1, [s["key"] for s in services]
    orchestrator = orchestrators[0]
    before = scrape(orchestrator)
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    seen = [Seen() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(_stream(client, pipeline.served_model_name, s)) for s in seen]
    for _ in range(200):  # streaming has begun
        if any(s.chunks for s in seen):
            break
        await asyncio.sleep(0.05)
    pid = nats_server.proc.pid
    nats_server.proc.send_signal(signal.SIGKILL)
    nats_server.proc.wait(5)
    assert gone(pid), "nats-server still running"
    down = time.monotonic()
    await asyncio.sleep(2.0)
    nats_server.start()  # same port, same store
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    await client.close()
    print(f"broker back after {time.monotonic() - down:.1f} s; tokens per stream: {[s.tokens for s in seen]}")
    assert [s.error for s in seen] == [None] * STREAMS, [str(s.error) for s in seen]
    assert all(s.tokens == MAX_TOKENS for s in seen)
    after = scrape(orchestrator)
    assert delta(before, after, "vllm:omni_replica_evictions_total") == 0
