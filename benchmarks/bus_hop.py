"""``omnirelay bench bus``: what one hop on the bus costs between two processes with no service
work on either side — the floor under each hop a request takes (prints a table).

A request through the gateway crosses two JetStream hops before its engine starts (gateway →
orchestrator, orchestrator → stage worker) and one core-NATS hop on the way back (worker →
gateway). This measures both kinds with the project's own plumbing and nothing else:

- ``jetstream``: a message published to a stage subject of a work-queue stream (the sender waits
  for the PubAck, as the gateway, orchestrator and workers do), received through the stage's
  durable pull consumer by :class:`libs.common.consumer.PullConsumer`, as a worker receives its tasks;
- ``core``: a core-NATS publish to a gateway's ``out`` subject, received by a subscription.

Latency is the receiver's wall clock at receipt minus the sender's just before the publish call
(one host, one clock), in ms. The messages are spaced, so each hop is measured on an idle bus.
Both sides run on uvloop, as the services do.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from benchmarks.harness import percentile
from libs.common.jetstream import JetStream
from libs.common.runtime import run_service

SENT_NS = "Bench-Sent-Ns"
"""Header of a benchmark message: the sender's wall clock (ns) just before publishing."""
MODES = ("jetstream", "core")
PIPELINE = "busbench"


@dataclass(frozen=True)
class HopStats:
    mode: str
    pinned: bool
    samples_ms: list[float]

    def row(self) -> str:
        xs = self.samples_ms
        p = [percentile(xs, q) for q in (10, 50, 90, 99)]
        where = "one core" if self.pinned else "any core"
        return f"{self.mode:10s} {where:9s} {len(xs):6d}" + "".join(f"{v:9.3f}" for v in p)


HEADER = f"{'hop':10s} {'processes':9s} {'msgs':>6s}" + "".join(
    f"{h:>9s}" for h in ("p10 ms", "p50 ms", "p90 ms", "p99 ms")
)


def render(stats: list[HopStats]) -> str:
    return "\n".join([HEADER, "-" * len(HEADER), *(s.row() for s in stats)])


def _receive(url: str, mode: str, count: int, conn: Connection, cpu: int | None) -> None:
    """Receiver process: tell the parent when subscribed, then send back ``count`` latencies (ms)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    conn.send(run_service(_receive_async(url, mode, count, conn)))


async def _receive_async(url: str, mode: str, count: int, conn: Connection) -> list[float]:
    from libs.common.bus import connect, consume, stage_consumer_config
    from libs.common.subjects import Subjects
    from libs.stack.bus_state import barrier

    subjects = Subjects(PIPELINE)
    nc = await connect(url, f"bench-bus-{mode}")
    got: list[float] = []
    done = asyncio.Event()

    def record(headers: dict[str, str] | None) -> None:
        got.append((time.time_ns() - int((headers or {})[SENT_NS])) / 1e6)
        if len(got) == count:
            done.set()

    async def on_msg(msg) -> None:
        record(msg.headers)
        if mode == "jetstream":
            await msg.ack()

    try:
        consumer = None
        if mode == "core":
            await nc.subscribe(subjects.out("bench", "hop"), cb=on_msg)
            await barrier(nc)  # the sender is told "ready" only once the server has the SUB
        else:
            cfg = stage_consumer_config(subjects, 0, 0)
            stream = subjects.stages_stream
            consumer = await consume(nc, nc.jetstream(), stream, cfg, on_msg, batch=64, name="bench-bus")
        conn.send("ready")
        await done.wait()
        if consumer is not None:
            await consumer.stop()
    finally:
        await nc.close()
    return got


async def _send(url: str, mode: str, count: int, interval_s: float) -> None:
    from libs.common.bus import connect
    from libs.common.subjects import Subjects

    subjects = Subjects(PIPELINE)
    nc = await connect(url, "bench-bus-sender")
    js = JetStream(nc)
    try:
        for _ in range(count):
            await asyncio.sleep(interval_s)
            headers = {SENT_NS: str(time.time_ns())}
            if mode == "core":
                await nc.publish(subjects.out("bench", "hop"), b"x" * 64, headers=headers)
            else:
                await js.publish(subjects.stage_in(0, 0), b"x" * 64, headers=headers)
    finally:
        await nc.close()


async def _prepare(url: str) -> None:
    from libs.common.bus import connect, ensure_topology
    from libs.common.subjects import Subjects

    nc = await connect(url, "bench-bus-setup")
    try:
        await ensure_topology(nc.jetstream(), Subjects(PIPELINE))
    finally:
        await nc.close()


def measure_hop(url: str, mode: str, count: int, interval_s: float, cpu: int | None) -> list[float]:
    """Latencies (ms) of ``count`` messages of ``mode`` from this process to a new one; both on
    ``cpu`` when given."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(url, mode, count, child, cpu), daemon=True)
    proc.start()
    try:
        if not parent.poll(60) or parent.recv() != "ready":
            raise RuntimeError(f"{mode} receiver did not start")
        run_service(_send(url, mode, count, interval_s))
        if not parent.poll(60):
            raise RuntimeError(f"{mode} receiver got fewer than {count} messages in 60 s")
        return parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run_bus_bench(messages: int, interval_s: float, warmup: int) -> list[HopStats]:
    """Start a private nats-server; measure each hop kind with the processes on any core, then
    with the server and both processes on one core (as ``omnirelay bench gateway`` puts every front end)."""
    from libs.stack.local_stack import Stack

    store = Path(tempfile.mkdtemp(prefix="omnirelay-bench-bus-"))
    stack = Stack(store, log_dir=store, name="bus bench")
    mine = os.sched_getaffinity(0)
    try:
        url = stack.start_nats()
        asyncio.run(_prepare(url))
        out = []
        for cpu in (None, max(mine)):
            for pid in (os.getpid(), stack.processes["nats"].pid):
                os.sched_setaffinity(pid, mine if cpu is None else {cpu})
            for mode in MODES:
                xs = measure_hop(url, mode, messages + warmup, interval_s, cpu)[warmup:]
                out.append(HopStats(mode, cpu is not None, xs))
        return out
    finally:
        os.sched_setaffinity(0, mine)
        stack.stop()
        shutil.rmtree(store, ignore_errors=True)
