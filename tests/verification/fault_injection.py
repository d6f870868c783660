"""The faults of ``omnirelay verify faults`` and ``omnirelay verify chaos`` and how they are
injected: the pipeline they are injected into (two replicas of every stage), the list of faults,
the :class:`Injector` that finds a fault's process and verifies that the fault took (the pid is
gone or a zombie, or in state ``T`` for ``SIGSTOP``), and the registry reads that tell when a
killed worker's (or orchestrator's) replacement is up.

The stack (:class:`libs.stack.local_stack.Stack`) is ``omnirelay up`` (its launcher restarts a
process that exits; the suite itself restarts the NATS servers it killed) or one process per
service, each under Docker's restart policy (:data:`libs.stack.processes.COMPOSE_RESTARTS`, as docker
compose runs it: NATS is restarted by its policy too, held back as long as the fault says).

Clocks: ``time.monotonic()`` of this process, seconds; ``started_ns`` in the registry is the
worker's wall clock (``time.time_ns()``), only compared with itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.process_table import descendants
from libs.common.bus import bucket_keys, server_urls
from libs.common.subjects import (
    BUCKETS,
    SERVICES_BUCKET,
    Subjects,
    kv_stream,
)
from libs.stack.local_stack import Stack, http_status
from libs.stack.processes import Process, until, wait_for

REPLICAS = 2
"""Replicas of every stage in :data:`~benchmarks.chat_streams.TWO_REPLICA_PIPELINE`."""
PIPELINE_NAME = "faults"
"""The ``name`` in :data:`~benchmarks.chat_streams.TWO_REPLICA_PIPELINE`."""
STAGE_NAMES = ("thinker", "talker", "code2wav")
"""The stages of :data:`~benchmarks.chat_streams.TWO_REPLICA_PIPELINE`, by id."""
TOOK_WITHIN_S = 2.5
"""How long a signalled process is watched for the state that shows the fault took, seconds."""
NATS_DOWN_S = 2.0
"""``kill -9`` of the only NATS server: it is started again this long after the kill, seconds."""


@dataclass(frozen=True)
class Fault:
    name: str
    target: str
    """``worker``, ``engine_core`` (the worker's EngineCore process), ``all_replicas`` (every
    replica of ``stage``: they stay down while their engines start), ``orchestrator``, ``nats``
    (the only server), ``nats_leader`` (the node of a NATS cluster that leads the stages stream) or
    ``nats_node_of_worker`` (the node the busiest replica of ``stage`` is connected to)."""
    stage: int = 0
    sig: int = signal.SIGKILL
    hold_s: float = 0.0
    """SIGSTOP: how long the process stays stopped before SIGCONT."""
    streams: int = 8
    audio: bool = False
    max_tokens: int = 1200
    """Tokens of each stream. A text stream of the tiny thinker takes about 1.2 s per 400 tokens on
    an idle 2-core box (four to a replica); 400 left the strike, which waits for two streams under
    way at the client and on the server, too narrow a window: a ``SIGSTOP`` landed 50 ms after the
    replica had finished its streams (no verdict, no move). 1200 leave seconds."""
    nats_nodes: int = 1
    """NATS servers of the stack the fault is injected in (1, or a cluster of 3)."""
    session: bool = False
    """The clients are realtime sessions that speak a turn and hear the answer
    (:mod:`tests.verification.fault_sessions`; ``streams`` of them, answers of at most ``max_tokens``)."""


AUDIO_STREAMS = {"streams": 4, "audio": True, "max_tokens": 400}
"""The broker rows' audio streams: several seconds of audio each, so a stream is still being
spoken, and its text still crossing the thinker → talker hop, when the broker goes."""
FAULTS = (
    Fault("kill -9 a thinker replica", "worker", 0),
    Fault("kill -9 a talker replica", "worker", 1, streams=4, audio=True, max_tokens=120),
    Fault("kill -9 a code2wav replica", "worker", 2, streams=4, audio=True, max_tokens=120),
    Fault("kill -9 a thinker's EngineCore only", "engine_core", 0),
    Fault("SIGSTOP a thinker replica 30 s", "worker", 0, signal.SIGSTOP, hold_s=30.0),
    Fault(
        "SIGSTOP a thinker's EngineCore 30 s (a hung engine)", "engine_core", 0, signal.SIGSTOP, hold_s=30.0
    ),
    Fault("kill -9 every thinker replica (down while their engines start)", "all_replicas", 0),
    Fault("kill -9 the orchestrator", "orchestrator"),
    Fault("kill -9 nats-server, back 2 s later", "nats"),
    Fault("kill -9 nats-server, back 2 s later (audio streams)", "nats", 1, **AUDIO_STREAMS),
    Fault("kill -9 one node of a 3-node NATS cluster, the streams' leader", "nats_leader", nats_nodes=3),
    Fault(
        "kill -9 the node of a 3-node NATS cluster a busy thinker is on", "nats_node_of_worker", nats_nodes=3
    ),
    Fault(
        "kill -9 the node of a 3-node NATS cluster a busy thinker is on (audio streams)",
        "nats_node_of_worker",
        nats_nodes=3,
        **AUDIO_STREAMS,
    ),
)
CLUSTER_NODE_TARGETS = ("nats_leader", "nats_node_of_worker")


@dataclass(frozen=True)
class Injection:
    """What an injection did."""

    verified: str
    """What was seen: each victim's pid and its state after the signal (``gone``, ``Z``, ``T``)."""
    took: bool
    """Every victim was seen gone or a zombie (stopped, for ``SIGSTOP``) within
    :data:`TOOK_WITHIN_S`: the fault happened."""
    pids: tuple[int, ...] = ()
    """The processes signalled."""


def matches(cmdline: str, words: tuple[str, ...]) -> bool:
    """True when every one of ``words`` is in ``cmdline`` (arguments joined by spaces; a forked
    service's title ends with ``[<name>]``, :mod:`libs.stack.forker`)."""
    return all(w in cmdline for w in words)


def pids_of(root: int, *words: str) -> list[int]:
    """Descendants of ``root`` whose command line contains every one of ``words`` (:func:`matches`)."""
    found = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if matches(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "), words):
                found.append(pid)
    return found


def victim_service(fault: Fault, replica: int) -> str:
    """The service a fault strikes, by its name in the process plan and the compose file:
    ``thinker-1`` (a worker, or its EngineCore), ``orchestrator``, ``nats``. Not for the faults
    of several services (``all_replicas``) or of a cluster node (chosen at the fault)."""
    if fault.target in ("worker", "engine_core"):
        return f"{STAGE_NAMES[fault.stage]}-{replica}"
    if fault.target in ("orchestrator", "nats"):
        return fault.target
    raise ValueError(f"{fault.target}: no one service")


def proc_state(pid: int) -> str:
    """The process state letter (``T`` stopped, ``Z`` zombie), ``gone`` when it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def took(state: str, sig: int) -> bool:
    """True when a process in ``state`` (:func:`proc_state`) shows that ``sig`` took: gone or a
    zombie, or stopped (``T``) for ``SIGSTOP``."""
    return state in ("gone", "Z") or (sig == signal.SIGSTOP and state == "T")


async def signal_and_verify(pids: list[int], sig: int) -> Injection:
    """Send ``sig`` to every one of ``pids`` and watch them (for at most :data:`TOOK_WITHIN_S`)
    until each shows that it took."""
    for pid in pids:
        os.kill(pid, sig)
    deadline = time.monotonic() + TOOK_WITHIN_S
    while not all(took(proc_state(pid), sig) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    states = [proc_state(pid) for pid in pids]
    verified = ", ".join(f"pid {pid} {state}" for pid, state in zip(pids, states, strict=True))
    return Injection(verified, all(took(state, sig) for state in states), tuple(pids))


async def _leaders(stack: Stack) -> dict[str, str]:
    """The server that leads each stream and KV bucket of the pipeline: name → ``server_name``."""
    import nats

    subjects = Subjects(PIPELINE_NAME)
    names = [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
    names += [kv_stream(b) for b in BUCKETS]
    nc = await nats.connect(servers=server_urls(stack.nats_url))
    try:
        js = nc.jetstream()
        return {name: (await js.stream_info(name)).cluster.leader for name in names}
    finally:
        await nc.close()


def _client_names(monitor_url: str) -> list[str]:
    """The omnirelay services connected to a server, from its ``/connz`` (names without the
    ``omnirelay-`` prefix: ``gateway-<id>``, ``orchestrator``, ``worker-<stage>-<replica>``)."""
    import httpx

    conns = httpx.get(f"{monitor_url}/connz", params={"limit": 1024}, timeout=5).json()["connections"] or []
    return [c["name"].removeprefix("omnirelay-") for c in conns if c.get("name", "").startswith("omnirelay-")]


_JUDGED_DEAD = re.compile(r"stage (\d+) \([^)]*\) replica (\d+) (?:is dead|died) \(")
"""An orchestrator's verdict on a replica: the eviction line ("stage 0 (thinker) replica 1 is dead
(exit: ...") or, where the stage had no live replica left, a failed request's ("... replica 1 died
(exit) and the stage has no live replica ...")."""


def verdicts_since(log_path: Path, offset: int) -> tuple[int, int]:
    """(replicas judged dead, requests moved) in a stack's log after byte ``offset``: the distinct
    (stage, replica) of the orchestrators' verdicts (:data:`_JUDGED_DEAD`), and their "request ...
    moved: stage" lines."""
    with log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    moved = sum(" moved: stage " in line for line in text.splitlines())
    return len(set(_JUDGED_DEAD.findall(text))), moved


def supervised(stack: Stack) -> bool:
    """Whether ``stack`` runs its services itself, each under its restart policy (NATS too), rather
    than through ``omnirelay up``."""
    return "up" not in stack.processes


def nats_healthy(process: Process, monitor: str, timeout_s: float) -> None:
    """Wait until the NATS server ``process`` (monitoring URL ``monitor``) reports JetStream
    healthy; RuntimeError after ``timeout_s``, or at once when its incarnation exits."""
    wait_for(
        lambda: http_status(f"{monitor}/healthz") == 200,
        f"{process.name} healthy",
        timeout_s,
        0.25,
        watch=[process],
    )


class Injector:
    """Finds a fault's process in the stack and injects the fault, verifying that it took."""

    def __init__(self, stack: Stack, stage_names: tuple[str, ...] = STAGE_NAMES) -> None:
        """``stage_names``: the pipeline's stages by id."""
        self.stack, self.stage_names = stack, stage_names
        self.killed_node: Process | None = None
        """The cluster node killed by the last fault of a cluster node: down until :meth:`restore`
        (:func:`supervised`: its restart is held until then)."""

    def _pid(self, service: str, *words: str) -> int:
        """The one process below the stack's root whose command line has ``words``; in a
        :func:`supervised` stack, it must be the one the policy of ``service`` started last (else
        RuntimeError)."""
        (pid,) = pids_of(self.stack.root_pid, *words)
        if supervised(self.stack) and pid != self.stack.processes[service].pid:
            raise RuntimeError(
                f"{service}: pid {pid} in /proc, but its policy started pid {self.stack.processes[service].pid}"
            )
        return pid

    def target_pid(self, fault: Fault, replica: int) -> int:
        if fault.target == "orchestrator":
            return self._pid("orchestrator", "-m cli orchestrator", "[orchestrator]")
        worker = self.worker_pid(fault.stage, replica)
        if fault.target == "worker":
            return worker
        (core,) = [p for p in descendants(worker) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()]
        return core

    def worker_pid(self, stage: int, replica: int) -> int:
        name = f"{self.stage_names[stage]}-{replica}"
        return self._pid(name, "-m cli worker", f"[{name}]")

    async def inject(self, fault: Fault, replica: int) -> Injection:
        """Inject ``fault`` (on ``replica`` of its stage, where it has one) and verify that it
        took. ``SIGSTOP``: returns after ``SIGCONT``, ``hold_s`` later; ``nats``: once the server
        is back on its store."""
        if fault.target in CLUSTER_NODE_TARGETS:
            return await self._kill_node(fault, replica)
        if fault.target == "nats":
            return await self._restart_nats()
        if fault.target == "all_replicas":  # they stay down while the launcher restarts them
            return await signal_and_verify(
                [self.worker_pid(fault.stage, r) for r in range(REPLICAS)], fault.sig
            )
        done = await signal_and_verify([self.target_pid(fault, replica)], fault.sig)
        if fault.sig != signal.SIGSTOP:
            return done
        await asyncio.sleep(fault.hold_s)
        try:
            os.kill(done.pids[0], signal.SIGCONT)
        except ProcessLookupError:  # a stopped EngineCore: its worker gave up on it and killed it
            return Injection(
                f"{done.verified}; gone before SIGCONT at {fault.hold_s:g} s", done.took, done.pids
            )
        return done

    async def _restart_nats(self) -> Injection:
        """``kill -9`` the stack's only NATS server and, :data:`NATS_DOWN_S` later, start it again
        on its store (a :func:`supervised` stack's: its policy does, held back until then); returns
        once its JetStream is healthy."""
        nats, monitor = self.stack.processes["nats"], self.stack.monitors["nats"]
        if supervised(self.stack):
            return await self._restart_nats_service(nats, monitor)
        pid = nats.pid
        assert nats.proc is not None
        nats.proc.kill()
        nats.proc.wait(5)
        state = proc_state(pid)
        await asyncio.sleep(NATS_DOWN_S)
        nats.start()  # the same command, store and log
        await asyncio.to_thread(nats_healthy, nats, monitor, 30)
        return Injection(f"pid {pid} {state}", took(state, signal.SIGKILL), (pid,))

    async def _restart_nats_service(self, service: Process, monitor: str) -> Injection:
        """``kill -9`` a supervised NATS server with its restart held back :data:`NATS_DOWN_S`;
        returns once its policy has started it again and its JetStream is healthy."""
        restarts = service.restarts
        service.hold(NATS_DOWN_S)
        done = await signal_and_verify([service.pid], signal.SIGKILL)
        t0 = time.monotonic()
        pid = await asyncio.to_thread(service.wait_restarted, restarts, NATS_DOWN_S + 30)
        await asyncio.to_thread(nats_healthy, service, monitor, 30)
        back = f"restarted by its policy as pid {pid}, healthy {time.monotonic() - t0:.1f} s after the kill"
        return Injection(f"{done.verified}; {back}", done.took, done.pids)

    async def _kill_node(self, fault: Fault, replica: int) -> Injection:
        """``kill -9`` a cluster node (it stays down until :meth:`restore`): the stages stream's
        leader, or the node worker (``fault.stage``, ``replica``) is connected to; says which of
        the pipeline's streams and buckets it led and which services were connected to it."""
        leaders = await _leaders(self.stack)
        clients = {
            n.name: await asyncio.to_thread(_client_names, n.monitor_url) for n in self.stack.nats_nodes
        }
        if fault.target == "nats_leader":
            victim = leaders[Subjects(PIPELINE_NAME).stages_stream]
        else:
            worker = f"worker-{fault.stage}-{replica}"
            (victim,) = [name for name, on_it in clients.items() if worker in on_it]
        node = self.stack.processes[victim]  # down until restore()
        if supervised(self.stack):  # its policy is held
            node.hold()
            done = await signal_and_verify([node.pid], signal.SIGKILL)
            pid, state = done.pids[0], proc_state(done.pids[0])
        else:
            assert node.proc is not None
            pid = node.pid
            os.kill(pid, signal.SIGKILL)
            node.proc.wait(5)
            state = proc_state(pid)
        self.killed_node = node
        led = sum(leader == victim for leader in leaders.values())
        on_it = ", ".join(sorted(clients[victim])) or "none"
        return Injection(
            f"pid {pid} {state} ({victim}: leader of {led} of the {len(leaders)} streams and buckets; "
            f"clients on it: {on_it})",
            took(state, signal.SIGKILL),
            (pid,),
        )

    def restore(self) -> None:
        """Start the killed cluster node again (same configuration and store) and wait until its
        JetStream is healthy, so the next fault meets a whole cluster (a :func:`supervised`
        stack's: its policy is let go, and restarts it)."""
        node, self.killed_node = self.killed_node, None
        if node is None:
            return
        if supervised(self.stack):
            restarts = node.restarts
            node.release()
            node.wait_restarted(restarts, 30)
        else:
            node.start()
        nats_healthy(node, self.stack.monitors[node.name], 60)


async def until_back(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    """:func:`~libs.stack.processes.until` asking every second, failing with ``RuntimeError``: what
    a run reports as its failure (``benchmarks.harness.run_with_stacks``), and the chaos soak as a
    victim that did not come back."""
    try:
        await until(check, what, timeout_s, every_s=1.0)
    except AssertionError as e:
        raise RuntimeError(str(e)) from None


async def health(stack: Stack) -> dict:
    """The gateway's ``/health`` body (``status``, ``orchestrators``, live replicas per stage in
    ``stages``, keyed ``<id>:<name>``); raises on no answer."""
    import httpx

    async with httpx.AsyncClient(timeout=5) as http:
        return (await http.get(f"{stack.base_url}/health")).json()


async def healthy(stack: Stack, timeout_s: float = 300.0) -> None:
    """Wait until every declared replica is live again (``/health`` status ``ok``)."""
    import httpx

    async def ok() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await health(stack)).get("status") == "ok"
        return False

    await until_back(ok, "the stack healed (every declared replica live)", timeout_s)


async def incarnation(stack: Stack, stage: int, replica: int) -> int:
    """``started_ns`` of the worker (stage, replica) in the registry (0 when it is not there);
    raises when the broker cannot be reached."""
    import nats

    from libs.common.bus import services_kv

    async def quiet(_: Exception) -> None:  # a broker that is down says so by raising
        return None

    nc = await nats.connect(servers=server_urls(stack.nats_url), error_cb=quiet, allow_reconnect=False)
    try:
        kv = await services_kv(nc.jetstream())
        with contextlib.suppress(Exception):
            return json.loads((await kv.get(f"worker.{PIPELINE_NAME}.{stage}.{replica}")).value)["started_ns"]
        return 0
    finally:
        await nc.close()


async def replaced(stack: Stack, stage: int, replica: int, before_ns: int, timeout_s: float = 300.0) -> None:
    """Wait until a new incarnation of the worker (stage, replica) has registered (its engine is
    up: a worker registers after its engine has started). A registry that cannot be read (the
    broker is down) is read again a second later."""

    async def registered() -> bool:
        with contextlib.suppress(Exception):
            return await incarnation(stack, stage, replica) > before_ns
        return False

    await until_back(registered, f"worker {stage}/{replica} replaced", timeout_s)


async def orchestrator_replaced(stack: Stack, after_ns: int, timeout_s: float = 300.0) -> None:
    """Wait until an orchestrator registered after ``after_ns`` (``time.time_ns()`` of this
    machine: its record's ``started_ns``): the killed one's replacement is on the bus. A registry
    that cannot be read (the broker is down) is read again a second later."""
    import nats

    from libs.common.bus import services_kv

    async def quiet(_: Exception) -> None:
        return None

    async def newest() -> int:
        nc = await nats.connect(servers=server_urls(stack.nats_url), error_cb=quiet, allow_reconnect=False)
        try:
            kv = await services_kv(nc.jetstream())
            started = [0]
            for key in await bucket_keys(nc, SERVICES_BUCKET):
                if key.startswith(f"orchestrator.{PIPELINE_NAME}."):
                    with contextlib.suppress(Exception):
                        started.append(json.loads((await kv.get(key)).value)["started_ns"])
            return max(started)
        finally:
            await nc.close()

    async def registered() -> bool:
        with contextlib.suppress(Exception):
            return await newest() > after_ns
        return False

    await until_back(registered, "an orchestrator replacing the killed one", timeout_s)
