"""``omnirelay bench-faults``: the fault suite. An ``omnirelay up`` stack (a pipeline with two
replicas of every stage, a NATS server of the suite's own; for the cluster's fault, a second stack on
a 3-node NATS cluster) serves streaming requests while one fault at a time is injected; each
injection is verified (the process is gone, or its state is ``T``), and each fault gets a row:
requests in flight, completed in full, failed with a clear error, hung, missing or repeated tokens,
and how long the streams paused.

Clocks: ``time.monotonic()`` of this process, seconds. The accounting (:func:`row_of`) is a pure
function of what the clients saw (tested in ``tests/unit/test_fault_suite.py``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.harness import (
    Managed,
    Processes,
    Stack,
    descendants,
    log,
    run_with_stacks,
    start_stack,
    wait_http_ok,
    wait_port,
)
from libs.common.bus import server_urls
from libs.common.subjects import EVICTIONS_BUCKET, REQUESTS_BUCKET, SERVICES_BUCKET, Subjects

PIPELINE_YAML = """\
name: faults
served_model_name: faults-model
request_timeout_s: 120
stages:
  - {name: thinker, type: llm, model: tiny-thinker, replicas: 2, consumes: text, emits: text,
     stream_to_client: true, engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}}
  - {name: talker, type: llm, model: tiny-talker, replicas: 2, consumes: text, emits: codec_codes,
     engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}}
  - {name: code2wav, type: codec, model: tiny-code2wav, replicas: 2, consumes: codec_codes,
     emits: audio, stream_to_client: true}
"""
PROMPT = "Tell me everything about the sea."
SAMPLE_RATE = 24_000
"""The tiny code2wav's output rate, Hz."""
MIDWAY_CHUNKS = 10
"""A stream is under way once it has this many chunks; the fault strikes when two are."""
HUNG_AFTER_S = 150.0
"""A stream not ended this long after the fault counts as hung (the deadline is 120 s), seconds."""
REFERENCE_RETRY_S = 30.0
"""How long the fault-free reference request is retried while the stack answers 503, seconds."""
REPLICAS = 2
"""Replicas of every stage in :data:`PIPELINE_YAML`."""
PIPELINE_NAME = "faults"
"""The ``name`` in :data:`PIPELINE_YAML`."""


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
    max_tokens: int = 400
    nats_nodes: int = 1
    """NATS servers of the stack the fault is injected in (1, or a cluster of 3)."""


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
    Fault("kill -9 one node of a 3-node NATS cluster, the streams' leader", "nats_leader", nats_nodes=3),
    Fault(
        "kill -9 the node of a 3-node NATS cluster a busy thinker is on", "nats_node_of_worker", nats_nodes=3
    ),
)


@dataclass
class Seen:
    """One client's stream (``time.monotonic()`` readings)."""

    id: str = ""
    token_ids: list[int] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    """When each chunk with tokens or audio arrived."""
    usage_tokens: int | None = None
    audio_bytes: int = 0
    error: str | None = None
    ended_s: float | None = None


@dataclass(frozen=True)
class Row:
    fault: str
    verified: str
    in_flight: int
    completed: int
    failed: dict[str, int]
    hung: int
    wrong_count: int
    """Completed streams whose token count is not ``max_tokens`` (missing or repeated)."""
    unlike_reference: int | None
    """Completed streams whose tokens differ from the same request's without a fault (greedy);
    None when no reference was given."""
    pause_s: float
    """The longest pause of a stream that went on after the fault, seconds."""
    audio_s: tuple[float, float] | None = None
    """Audio faults: the shortest and longest audio of a completed stream, seconds (24 kHz PCM16)."""
    error_s: float | None = None
    """The longest time from the fault to a failed stream's error, seconds (None: none failed)."""
    replaced_s: float | None = None
    """A worker killed (or one that gave up on its engine): seconds from the fault until its
    replacement registered, its engine started (None: not measured)."""


def row_of(
    fault: Fault, verified: str, fault_s: float, seen: list[Seen], reference: list[int] | None = None
) -> Row:
    """The row of one fault from what its clients saw (pure); ``reference``: the tokens of the
    same request without a fault."""
    failed: dict[str, int] = {}
    completed = hung = wrong = unlike = 0
    pause = 0.0
    to_error: list[float] = []
    for s in seen:
        if s.ended_s is None:
            hung += 1
            continue
        if s.error is not None:
            failed[s.error] = failed.get(s.error, 0) + 1
            to_error.append(s.ended_s - fault_s)
            continue
        completed += 1
        if len(s.token_ids) != fault.max_tokens or s.usage_tokens != fault.max_tokens:
            wrong += 1
        unlike += reference is not None and s.token_ids != reference
        after = [t for t in s.at if t > fault_s]
        if after and len(after) < len(s.at):
            gaps = [b - a for a, b in zip(s.at, s.at[1:], strict=False) if b > fault_s]
            pause = max(pause, *gaps)
    lengths = [s.audio_bytes / 2 / SAMPLE_RATE for s in seen if s.ended_s is not None and s.error is None]
    audio = (min(lengths), max(lengths)) if fault.audio and lengths else None
    return Row(
        fault.name,
        verified,
        len(seen),
        completed,
        failed,
        hung,
        wrong,
        None if reference is None else unlike,
        pause,
        audio,
        max(to_error) if to_error else None,
    )


async def _stream(client, model: str, fault: Fault, seen: Seen) -> None:
    import openai

    extra: dict[str, object] = {"ignore_eos": True, "return_token_ids": True}
    kwargs: dict[str, object] = {}
    if fault.audio:
        kwargs = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=fault.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **kwargs,
        )
        async for chunk in stream:
            seen.id = chunk.id
            if chunk.choices:
                ids = (chunk.choices[0].model_extra or {}).get("token_ids") or []
                audio = chunk.choices[0].delta.audio
                data = audio.data if audio is not None else None
                if ids or data:
                    seen.at.append(time.monotonic())
                seen.token_ids += ids
                if data:
                    seen.audio_bytes += len(base64.b64decode(data))
            if chunk.usage is not None:
                seen.usage_tokens = chunk.usage.completion_tokens
            await asyncio.sleep(0)  # a whole response already read would otherwise end unseen
    except openai.APIError as e:
        seen.error = str(getattr(e, "code", None) or type(e).__name__)
    seen.ended_s = time.monotonic()


async def _reference(client, model: str, fault: Fault) -> list[int]:
    """The thinker's tokens for the suite's request without a fault (greedy, text only). A 503
    (no live replica: the registry has not caught up with the last fault yet) is asked again, for
    at most :data:`REFERENCE_RETRY_S`."""
    import openai

    deadline = time.monotonic() + REFERENCE_RETRY_S
    while True:
        try:
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=fault.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return (r.choices[0].model_extra or {}).get("token_ids") or []
        except openai.InternalServerError as e:
            if e.status_code != 503 or time.monotonic() > deadline:
                raise
            log(f"reference request: {e}; asking again")
            await asyncio.sleep(1.0)


def _pids(root: int, *words: str) -> list[int]:
    """Descendants of ``root`` whose command line contains every one of ``words``."""
    found = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            env = Path(f"/proc/{pid}/environ").read_text().split("\0")
            if all(w in cmd or w in env for w in words):
                found.append(pid)
    return found


def _state(pid: int) -> str:
    """The process state letter (``T`` stopped, ``Z`` zombie), ``gone`` when it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def _busiest_replica(stack: Stack, stage: int, ids: list[str]) -> tuple[int, int]:
    """The replica of ``stage`` that the most of ``ids`` run on (from their records), and how
    many of them do."""
    import nats

    from libs.common.bus import requests_kv

    nc = await nats.connect(servers=server_urls(stack.nats_url))
    try:
        kv = await requests_kv(nc.jetstream())
        counts: dict[int, int] = {}
        for rid in ids:
            with contextlib.suppress(Exception):
                rec = json.loads((await kv.get(rid)).value)
                if len(rec["route"]) > stage:
                    counts[rec["route"][stage]] = counts.get(rec["route"][stage], 0) + 1
        replica = max(counts, key=counts.__getitem__) if counts else 0
        return replica, counts.get(replica, 0)
    finally:
        await nc.close()


async def _leaders(stack: Stack) -> dict[str, str]:
    """The server that leads each stream and KV bucket of the pipeline: name → ``server_name``."""
    import nats

    subjects = Subjects(PIPELINE_NAME)
    names = [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
    names += [f"KV_{b}" for b in (SERVICES_BUCKET, REQUESTS_BUCKET, EVICTIONS_BUCKET)]
    nc = await nats.connect(servers=server_urls(stack.nats_url))
    try:
        js = nc.jetstream()
        return {name: (await js.stream_info(name)).cluster.leader for name in names}
    finally:
        await nc.close()


CLUSTER_NODE_TARGETS = ("nats_leader", "nats_node_of_worker")


def _client_names(monitor_url: str) -> list[str]:
    """The omnirelay services connected to a server, from its ``/connz`` (names without the
    ``omnirelay-`` prefix: ``gateway-<id>``, ``orchestrator``, ``worker-<stage>-<replica>``)."""
    import httpx

    conns = httpx.get(f"{monitor_url}/connz", params={"limit": 1024}, timeout=5).json()["connections"] or []
    return [c["name"].removeprefix("omnirelay-") for c in conns if c.get("name", "").startswith("omnirelay-")]


def _log_size(m: Managed) -> int:
    """Bytes in ``m``'s log so far."""
    return m.log_path.stat().st_size


def verdicts_since(log_path: Path, offset: int) -> tuple[int, int]:
    """(replicas judged dead, requests moved) in a stack's log after byte ``offset`` (the
    orchestrators' "stage ... replica ... is dead (" and "request ... moved: stage" lines)."""
    with log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return text.count(" is dead ("), sum(" moved: stage " in line for line in text.splitlines())


class Injector:
    """Finds a fault's process in the stack and injects the fault, verifying that it took."""

    def __init__(self, procs: Processes, stack: Stack, nats_argv: list[str]) -> None:
        self.procs, self.stack, self.nats_argv = procs, stack, nats_argv
        self.killed_node: tuple[Managed, str] | None = None
        """The cluster node killed by the last fault of a cluster node, with its monitoring URL."""

    def target_pid(self, fault: Fault, replica: int) -> int:
        root = self.stack.process.proc.pid
        if fault.target == "orchestrator":
            (pid,) = _pids(root, "-m cli orchestrator")
            return pid
        worker = self.worker_pid(fault.stage, replica)
        if fault.target == "worker":
            return worker
        (core,) = [p for p in descendants(worker) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()]
        return core

    def worker_pid(self, stage: int, replica: int) -> int:
        (pid,) = _pids(
            self.stack.process.proc.pid,
            "-m cli worker",
            f"OMNIRELAY_STAGE={stage}",
            f"OMNIRELAY_REPLICA={replica}",
        )
        return pid

    async def _kill_all_replicas(self, stage: int) -> str:
        """``kill -9`` every replica of ``stage`` at once; they stay down while the launcher
        restarts them and their engines start."""
        pids = [self.worker_pid(stage, r) for r in range(REPLICAS)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            if all(_state(pid) in ("gone", "Z") for pid in pids):
                break
            await asyncio.sleep(0.05)
        return ", ".join(f"pid {pid} {_state(pid)}" for pid in pids)

    async def inject(self, fault: Fault, replica: int) -> str:
        """Inject ``fault``; what was verified."""
        if fault.target in CLUSTER_NODE_TARGETS:
            return await self._kill_node(fault, replica)
        if fault.target == "nats":
            nats = next(m for m in self.procs.items if m.name.startswith("nats"))
            pid = nats.proc.pid
            os.kill(pid, signal.SIGKILL)
            nats.proc.wait(5)
            verified = f"pid {pid} {_state(pid)}"
            await asyncio.sleep(2.0)
            port = int(self.nats_argv[self.nats_argv.index("-p") + 1])
            wait_port(self.procs.start("nats (restarted)", self.nats_argv, {}), port, 30)
            return verified
        if fault.target == "all_replicas":
            return await self._kill_all_replicas(fault.stage)
        pid = self.target_pid(fault, replica)
        os.kill(pid, fault.sig)
        for _ in range(50):
            state = _state(pid)
            if state in ("gone", "Z") or (fault.sig == signal.SIGSTOP and state == "T"):
                break
            await asyncio.sleep(0.05)
        verified = f"pid {pid} {_state(pid)}"
        if fault.sig == signal.SIGSTOP:
            await asyncio.sleep(fault.hold_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # a stopped EngineCore: its worker gave up on it and killed it
                verified += f"; gone before SIGCONT at {fault.hold_s:g} s"
        return verified

    async def _kill_node(self, fault: Fault, replica: int) -> str:
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
        (node,) = [n for n in self.stack.nats_nodes if n.name == victim]
        (managed,) = [m for m in self.procs.items if m.name == f"{victim} ({self.stack.name})"]
        pid = managed.proc.pid
        os.kill(pid, signal.SIGKILL)
        managed.proc.wait(5)
        self.killed_node = (managed, node.monitor_url)
        led = sum(leader == victim for leader in leaders.values())
        on_it = ", ".join(sorted(clients[victim])) or "none"
        return (
            f"pid {pid} {_state(pid)} ({victim}: leader of {led} of the {len(leaders)} streams and buckets; "
            f"clients on it: {on_it})"
        )

    def restore(self) -> None:
        """Start the killed cluster node again (same configuration and store) and wait until its
        JetStream is healthy, so the next fault meets a whole cluster."""
        if self.killed_node is None:
            return
        managed, monitor = self.killed_node
        name = managed.name.replace(" (", " (restarted, ", 1)
        wait_http_ok(self.procs.start(name, list(managed.proc.args), {}), f"{monitor}/healthz", 60)
        self.killed_node = None


async def _healthy(stack: Stack, timeout_s: float = 300.0) -> None:
    """Wait until every declared replica is live again (``/health`` status ``ok``)."""
    import httpx

    url = stack.base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).json().get("status") == "ok":
                    return
            await asyncio.sleep(1.0)
    raise RuntimeError(f"the stack did not heal within {timeout_s:.0f} s")


async def _incarnation(stack: Stack, stage: int, replica: int) -> int:
    """``started_ns`` of the worker (stage, replica) in the registry (0 when it is not there)."""
    import nats

    from libs.common.bus import services_kv

    nc = await nats.connect(servers=server_urls(stack.nats_url))
    try:
        kv = await services_kv(nc.jetstream())
        with contextlib.suppress(Exception):
            return json.loads((await kv.get(f"worker.faults.{stage}.{replica}")).value)["started_ns"]
        return 0
    finally:
        await nc.close()


async def _replaced(stack: Stack, stage: int, replica: int, before_ns: int, timeout_s: float = 300.0) -> None:
    """Wait until a new incarnation of the worker (stage, replica) has registered (its engine is
    up: a worker registers after its engine has started)."""
    deadline = time.monotonic() + timeout_s
    while await _incarnation(stack, stage, replica) <= before_ns:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {stage}/{replica} was not replaced within {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def run_fault(injector: Injector, fault: Fault, model: str) -> Row:
    from openai import AsyncOpenAI

    await _healthy(injector.stack)
    client = AsyncOpenAI(
        base_url=injector.stack.base_url, api_key="unused", max_retries=0, timeout=HUNG_AFTER_S
    )
    reference = await _reference(client, model, fault)
    seen = [Seen() for _ in range(fault.streams)]
    tasks = [asyncio.create_task(_stream(client, model, fault, s)) for s in seen]
    while sum(len(s.at) >= MIDWAY_CHUNKS and s.ended_s is None for s in seen) < 2:
        if all(t.done() for t in tasks):  # the stack is broken: say so, and go on
            await client.close()
            return row_of(fault, "not injected: the streams ended first", time.monotonic(), seen, reference)
        await asyncio.sleep(0.05)
    # The victim: the replica of the stage that most of the streams already under way run on.
    under_way = [s.id for s in seen if len(s.at) >= MIDWAY_CHUNKS and s.ended_s is None]
    replica, on_it = await _busiest_replica(injector.stack, fault.stage, under_way)
    befores = [await _incarnation(injector.stack, fault.stage, r) for r in range(REPLICAS)]
    before_ns = befores[replica]
    log_offset = _log_size(injector.stack.process)
    fault_s = time.monotonic()
    verified = await injector.inject(fault, replica)
    if fault.target in ("worker", "engine_core"):
        verified += f"; {on_it} of {len(under_way)} streams under way on it"
    log(f"{fault.name}: injected ({verified})")
    await asyncio.wait(tasks, timeout=HUNG_AFTER_S)
    for t in tasks:
        t.cancel()
    await client.close()
    if fault.target in CLUSTER_NODE_TARGETS:  # what the orchestrators made of the node's death
        dead, moved = verdicts_since(injector.stack.process.log_path, log_offset)
        verified += f"; then {dead} replica(s) judged dead, {moved} request(s) moved"
        await asyncio.to_thread(injector.restore)
    row = row_of(fault, verified, fault_s, seen, reference)
    # The next fault meets a whole stack: a killed worker (or one that gave up on its hung engine)
    # is replaced by the launcher; the column says when its engine was up again.
    if fault.target == "all_replicas":
        for r in range(REPLICAS):
            await _replaced(injector.stack, fault.stage, r, befores[r])
        row = replace(row, replaced_s=time.monotonic() - fault_s)
    elif fault.target == "engine_core" or (fault.target == "worker" and fault.sig == signal.SIGKILL):
        await _replaced(injector.stack, fault.stage, replica, before_ns)
        row = replace(row, replaced_s=time.monotonic() - fault_s)
    return row


def render(rows: list[Row]) -> str:
    head = (
        "fault",
        "verified",
        "in flight",
        "completed",
        "failed (code)",
        "hung",
        "wrong token count",
        "unlike fault-free",
        "longest pause s",
        "audio s (min–max)",
        "to error s",
        "replaced s",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        failed = ", ".join(f"{n} {c}" for c, n in sorted(r.failed.items())) or "0"
        audio = f"{r.audio_s[0]:.2f}–{r.audio_s[1]:.2f}" if r.audio_s else "-"
        unlike = "-" if r.unlike_reference is None else r.unlike_reference
        cells = (
            r.fault,
            r.verified,
            r.in_flight,
            r.completed,
            failed,
            r.hung,
            r.wrong_count,
            unlike,
            f"{r.pause_s:.2f}",
            audio,
            "-" if r.error_s is None else f"{r.error_s:.2f}",
            "-" if r.replaced_s is None else f"{r.replaced_s:.1f}",
        )
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(f"| {line} |" for line in lines)


def run_fault_suite(only: str | None = None, keep_logs: bool = False) -> int:
    """Start the stacks the selected faults need (every fault, or those whose name contains
    ``only``), run the faults in order, print the table (and, with ``keep_logs``, where the
    stacks' logs are)."""
    rows: list[Row] = []
    selected = [f for f in FAULTS if not only or only in f.name]

    def work(procs: Processes, data_dir: Path) -> None:
        pipeline = data_dir / "faults.yaml"
        pipeline.write_text(PIPELINE_YAML)
        for nodes in sorted({f.nats_nodes for f in selected}):
            name = "faults" if nodes == 1 else f"faults-{nodes}-node-nats"
            stack = start_stack(procs, name, pipeline, {}, data_dir, ["--log-stats"], nats_nodes=nodes)
            nats = next(m for m in procs.items if m.name.startswith("nats") and m.name.endswith(f"({name})"))
            injector = Injector(procs, stack, list(nats.proc.args))
            for fault in (f for f in selected if f.nats_nodes == nodes):
                rows.append(asyncio.run(run_fault(injector, fault, "faults-model")))
                log(render(rows[-1:]).splitlines()[-1])
            stack.process.stop()  # the next stack gets the machine to itself

    code = run_with_stacks("omnirelay-faults-", work, keep=keep_logs)
    print(render(rows))
    return code
