"""``omnirelay verify faults``: the fault suite. A stack (a pipeline with two replicas of every
stage, a NATS server of the suite's own; for the cluster's fault, a second stack on a 3-node NATS
cluster) serves streaming requests while one fault at a time is injected; each injection is verified
(the process is gone, or its state is ``T``), and each fault gets a row: requests in flight,
completed in full, failed with a clear error, hung, missing or repeated tokens, how long the streams
paused, and when a killed process's replacement was up.

Two modes (:data:`MODES`): ``up`` runs the stack as ``omnirelay up`` (its launcher restarts a process
that exits); ``services`` as docker compose runs it, one process per service (every NATS server, the
orchestrator, each worker, the gateway), each under a restart policy like ``restart: unless-stopped``
(:func:`start_services`).

The faults, the pipeline and the injection are :mod:`tests.verification.fault_injection`'s; the clients'
requests (:func:`benchmarks.chat_streams.send`, :func:`reference`) are shared with ``omnirelay verify chaos``.

Clocks: ``time.monotonic()`` of this process, seconds. The accounting (:func:`row_of`) is a pure
function of what the clients saw (tested in ``tests/unit/test_fault_suite.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.chat_streams import MODEL, Seen, send
from benchmarks.harness import Processes, log, run_with_stacks, start_stack
from libs.common.bus import bucket_keys, server_urls
from libs.common.pipeline import load_pipeline
from libs.common.subjects import REQUESTS_BUCKET, Subjects
from libs.stack.local_nats import SYNC_INTERVAL, free_port
from libs.stack.local_stack import Stack
from libs.stack.process_plan import plan_services
from libs.stack.processes import COMPOSE_RESTARTS
from tests.verification.audio_accounting import AudioTally, ChunkJudge
from tests.verification.fault_injection import (
    CLUSTER_NODE_TARGETS,
    PIPELINE_NAME,
    REPLICAS,
    Fault,
    Injector,
    healthy,
    incarnation,
    orchestrator_replaced,
    replaced,
    verdicts_since,
)
from tests.verification.fault_pipelines import pipelines
from tests.verification.fault_sessions import SAMPLES_PER_TOKEN, caller_speech, send_session

PROMPT = "Tell me everything about the sea."
SAMPLE_RATE = 24_000
"""The tiny code2wav's output rate, Hz."""
MIDWAY_CHUNKS = 10
"""A stream is under way once it has this many chunks; the fault strikes when two are."""
HUNG_AFTER_S = 150.0
"""A stream not ended this long after the fault counts as hung (the deadline is 120 s), seconds."""
REFERENCE_RETRY_S = 30.0
"""How long the fault-free reference request is retried while the stack answers 503, seconds."""
LLM_STAGES = ("thinker", "talker")
"""The suite's stages that run an engine (the others hold requests: the listener, code2wav)."""
MODES = ("up", "services")
"""How the suite runs the stack: ``omnirelay up``, or one process per service under a restart policy."""


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
    """Completed streams whose tokens differ from the same request's without a fault (greedy; a
    realtime session: what the listener heard); None when no reference was given."""
    pause_s: float
    """The longest pause of a stream that went on after the fault, seconds."""
    audio_s: tuple[float, float] | None = None
    """Audio faults: the shortest and longest audio of a completed stream, seconds (24 kHz PCM16)."""
    error_s: float | None = None
    """The longest time from the fault to a failed stream's error, seconds (None: none failed)."""
    replaced_s: float | None = None
    """A worker killed (or one that gave up on its engine): seconds from the fault until its
    replacement registered, its engine started; the orchestrator killed: until a new one
    registered (None: not measured)."""
    chunks: AudioTally | None = None
    """The completed audio streams' chunks against the whole decode of the code chunks sent on
    the bus (the ``orpheus`` pipeline; None: not judged)."""
    struck: bool = True
    """The fault was injected while the streams ran and its victims were seen gone, zombies or
    stopped (``Injection.took``)."""


def whole(fault: Fault, s: Seen) -> bool:
    """Whether a completed stream has every token once: ``max_tokens`` of them, counted and in
    the usage; a realtime session's answer: audio of exactly its ``output_tokens`` (the tiny
    talker speaks each as :data:`SAMPLES_PER_TOKEN` samples; sampled, it may stop early)."""
    if fault.session:
        return bool(s.usage_tokens) and s.audio_bytes == 2 * SAMPLES_PER_TOKEN * s.usage_tokens
    return len(s.token_ids) == fault.max_tokens and s.usage_tokens == fault.max_tokens


def answer(fault: Fault, s: Seen) -> object:
    """What is compared with the fault-free run: the tokens (greedy), or, for a realtime
    session (whose answer is sampled), what the listener heard."""
    return s.heard if fault.session else s.token_ids


def row_of(
    fault: Fault, verified: str, fault_s: float, seen: list[Seen], reference: Seen | None = None
) -> Row:
    """The row of one fault from what its clients saw (pure); ``reference``: the same request
    without a fault."""
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
        wrong += not whole(fault, s)
        unlike += reference is not None and answer(fault, s) != answer(fault, reference)
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


NO_LIVE_REPLICA = "no_live_replica"
"""The error every stream of an "every replica" row must end with (503)."""


def passed(fault: Fault, row: Row) -> bool:
    """Whether ``row`` keeps the promise (docs/reliability.md, "The fault suite"): the fault
    struck, every stream completed (every replica of a stage down: every one answered 503
    ``no_live_replica``), none hung, none has a wrong token count or differs from the fault-free
    run, and no audio chunk is missing, repeated or unlike the whole decode."""
    if not row.struck:
        return False
    if fault.target == "all_replicas":
        ended = row.failed == {NO_LIVE_REPLICA: row.in_flight}
    else:
        ended = row.completed == row.in_flight
    c = row.chunks
    audio_ok = c is None or not (c.missing or c.repeated or c.unlike or c.input_unlike)
    return ended and not row.hung and not row.wrong_count and not row.unlike_reference and audio_ok


async def reference(
    client, model: str, prompt: str, max_tokens: int, audio: bool = False, stream: bool = False
) -> Seen:
    """The request without a fault (greedy): what :func:`send` saw. A 503 (no live replica: the
    registry has not caught up with the last fault yet) is asked again, for at most
    :data:`REFERENCE_RETRY_S`; another failure raises RuntimeError."""
    deadline = time.monotonic() + REFERENCE_RETRY_S
    while True:
        seen = Seen()
        await send(client, model, seen, prompt, max_tokens, audio, stream)
        if seen.error is None:
            return seen
        if seen.status != 503 or time.monotonic() > deadline:
            raise RuntimeError(f"the reference request ({max_tokens} tokens) failed: {seen.error}")
        log(f"reference request: {seen.error}; asking again")
        await asyncio.sleep(1.0)


def bound_in_stage(records: list[dict], stage: int) -> dict[str, int]:
    """Request id → the replica of ``stage`` it is bound to, for each of ``records`` (request
    records as stored, JSON-decoded) still under way in that stage on the server: the request not
    ended, and the stage not done for it (queued there, or running)."""
    bound = {}
    for rec in records:
        if rec["status"] in ("completed", "failed", "aborted") or len(rec["route"]) <= stage:
            continue
        if len(rec["stages"]) > stage and rec["stages"][stage].get("done_ns"):
            continue
        bound[rec["request_id"]] = rec["route"][stage]
    return bound


def busiest(bound: dict[str, int]) -> tuple[int, int]:
    """The replica the most of ``bound`` (:func:`bound_in_stage`) are on (the lowest of a tie),
    and how many are."""
    counts: dict[int, int] = {}
    for replica in bound.values():
        counts[replica] = counts.get(replica, 0) + 1
    replica = min(counts, key=lambda r: (-counts[r], r))
    return replica, counts[replica]


async def _strike_moment(
    injector: Injector, fault: Fault, seen: list[Seen], tasks: list[asyncio.Task]
) -> dict[str, int] | None:
    """Wait for the moment to strike: at least two streams under way both at the client (they have
    :data:`MIDWAY_CHUNKS` chunks and have not ended; a fault of a realtime session's listener: the
    sessions are speaking) and on the server (their records: :func:`bound_in_stage`), and the
    replica most of them run on says its engine is busy (its liveness answer); returns those
    streams' replicas of the fault's stage. None when every stream ended first. The client alone
    would not do: a loaded client reads seconds behind the server, and a fault then struck a
    replica that had already finished every stream; the records alone lag the engine too (a
    `SIGSTOP` once landed after the replica's last token: nothing to judge or move)."""
    import nats

    from libs.common.bus import requests_kv

    stage = fault.stage
    listener = injector.stage_names[stage] == "listener"
    nc = await nats.connect(servers=server_urls(injector.stack.nats_url))
    try:
        kv = await requests_kv(nc.jetstream())
        while not all(t.done() for t in tasks):
            under_way = [s.id for s in seen if s.ended_s is None and (listener or len(s.at) >= MIDWAY_CHUNKS)]
            if len(under_way) >= 2:
                # A session's requests (its turn's transcription, its answer) are not the
                # client's to name: every request of the pipeline is read.
                ids = await bucket_keys(nc, REQUESTS_BUCKET) if fault.session else under_way
                records = []
                for rid in ids:
                    with contextlib.suppress(Exception):  # the record follows the stream's start
                        records.append(json.loads((await kv.get(rid)).value))
                bound = bound_in_stage(records, stage)
                if len(bound) >= 2 and await _engine_busy(nc, injector, stage, busiest(bound)[0]):
                    return bound
            await asyncio.sleep(0.05)
        return None
    finally:
        await nc.close()


async def _engine_busy(nc, injector: Injector, stage: int, replica: int) -> bool:
    """Whether worker (``stage``, ``replica``) of the suite's pipeline answers its liveness probe
    with work under way: a generation waiting for its engine (an ``llm`` stage), a request in hand
    (code2wav, which decodes only now and then, and the listener); False when it does not answer
    within 2 s."""
    from libs.common.envelopes import Liveness, decode

    with contextlib.suppress(Exception):
        answer = await nc.request(Subjects(PIPELINE_NAME).alive(stage, replica), b"", timeout=2)
        live = decode(Liveness, answer.data)
        return live.busy > 0 if injector.stage_names[stage] in LLM_STAGES else live.in_flight > 0
    return False


async def run_fault(injector: Injector, fault: Fault, model: str, judge: ChunkJudge | None = None) -> Row:
    """One fault's row; ``judge``: also judge the chunks of its streams against the bus, when
    they carry audio (a text stream, or a realtime session, has no chunk to judge)."""
    from openai import AsyncOpenAI

    await healthy(injector.stack)
    client = AsyncOpenAI(
        base_url=injector.stack.api_url, api_key="unused", max_retries=0, timeout=HUNG_AFTER_S
    )
    if fault.session:
        pcm = await asyncio.to_thread(caller_speech)
        ref = Seen()
        await send_session(injector.stack.api_url, model, ref, pcm, fault.max_tokens)
        if ref.error is not None or ref.ended_s is None:
            raise RuntimeError(f"the fault-free session failed: {ref.error or 'no end'}")
    else:
        ref = await reference(client, model, PROMPT, fault.max_tokens)
    befores = [await incarnation(injector.stack, fault.stage, r) for r in range(REPLICAS)]
    log_offset = injector.stack.log_path.stat().st_size
    judge = judge if fault.audio and not fault.session else None
    seen = [Seen(keep_audio=judge is not None) for _ in range(fault.streams)]
    async with contextlib.AsyncExitStack() as listening:
        capture = (
            None if judge is None else await listening.enter_async_context(judge.capture(injector.stack))
        )
        tasks = [
            asyncio.create_task(
                send_session(injector.stack.api_url, model, s, pcm, fault.max_tokens)
                if fault.session
                else send(client, model, s, PROMPT, fault.max_tokens, fault.audio)
            )
            for s in seen
        ]
        row = await _strike_and_watch(injector, fault, seen, tasks, befores, log_offset, ref)
        await client.close()
    if capture is None:
        return row
    completed = [
        (s.id, s.audio_pieces, s.token_ids) for s in seen if s.ended_s is not None and s.error is None
    ]
    tally, broken = judge.tally(completed, capture)
    for rid in broken + [s.id for s in seen if s.id and (s.ended_s is None or s.error is not None)]:
        log(f"{fault.name}: {capture.summary(rid)}")  # the evidence, in the suite's output
    return replace(row, chunks=tally)


async def _strike_and_watch(
    injector: Injector,
    fault: Fault,
    seen: list[Seen],
    tasks: list[asyncio.Task],
    befores: list[int],
    log_offset: int,
    ref: Seen,
) -> Row:
    """Strike once the streams are under way, wait for them to end and for the victim's
    replacement: the row, with what the orchestrators made of the fault."""
    bound = await _strike_moment(injector, fault, seen, tasks)
    if bound is None:  # the stack is broken, or too fast for the streams: say so, and go on
        await asyncio.wait(tasks)
        row = row_of(fault, "not injected: the streams ended first", time.monotonic(), seen, ref)
        return replace(row, struck=False)
    # The victim: the replica of the stage that most of the streams under way run on.
    replica, on_it = busiest(bound)
    # Watched from the fault on (a replacement registers with a later started_ns than befores').
    back = asyncio.create_task(_replacement(injector.stack, fault, replica, befores, time.time_ns()))
    fault_s = time.monotonic()
    try:
        injection = await injector.inject(fault, replica)
    except BaseException:
        back.cancel()
        raise
    verified = injection.verified
    if fault.target in ("worker", "engine_core"):
        verified += f"; {on_it} of {len(bound)} streams under way on it"
    log(f"{fault.name}: injected ({verified})")
    await asyncio.wait(tasks, timeout=HUNG_AFTER_S)
    for t in tasks:
        t.cancel()
    # What the orchestrators made of the fault (a kill that moved nothing struck nothing).
    dead, moved = verdicts_since(injector.stack.log_path, log_offset)
    verified += f"; then {dead} replica(s) judged dead, {moved} request(s) moved"
    if fault.target in CLUSTER_NODE_TARGETS:
        await asyncio.to_thread(injector.restore)
    row = replace(row_of(fault, verified, fault_s, seen, ref), struck=injection.took)
    # The next fault meets a whole stack: a killed worker (or one that gave up on its hung engine)
    # or orchestrator is replaced (by the launcher, or by its restart policy); the column says when.
    back_s = await back
    return row if back_s is None else replace(row, replaced_s=back_s - fault_s)


def replaced_by_a_new_process(fault: Fault) -> bool:
    """True when ``fault`` ends its victim's process (a kill, or a hung engine its worker gives up
    on), so that the row waits for the replacement; a stopped worker is continued instead, and a
    NATS server is started again by the injection itself."""
    if fault.target in ("all_replicas", "engine_core", "orchestrator"):
        return True
    return fault.target == "worker" and fault.sig == signal.SIGKILL


async def _replacement(
    stack: Stack, fault: Fault, replica: int, befores: list[int], fault_ns: int
) -> float | None:
    """``time.monotonic()`` when the victim of ``fault`` was replaced: every killed worker's new
    incarnation registered after its ``befores`` one (its engine up), or an orchestrator registered
    after ``fault_ns`` (``time.time_ns()``); None for a fault whose victim is not replaced."""
    if not replaced_by_a_new_process(fault):
        return None
    if fault.target == "orchestrator":
        await orchestrator_replaced(stack, fault_ns)
    else:
        for r in range(REPLICAS) if fault.target == "all_replicas" else [replica]:
            await replaced(stack, fault.stage, r, befores[r])
    return time.monotonic()


def start_services(
    procs: Processes,
    name: str,
    pipeline_path: Path,
    data_dir: Path,
    nats_nodes: int = 1,
    sync_interval: str = SYNC_INTERVAL,
    log_stats: bool = True,
) -> Stack:
    """The stack as docker compose runs it, without containers: NATS (one server, or a cluster of
    ``nats_nodes``), then the orchestrator, every worker and the gateway of the pipeline at
    ``pipeline_path`` (compose's plan, :func:`libs.stack.process_plan.plan_services`), each its own
    process; once every replica is live, each under Docker's restart policy
    (:data:`~libs.stack.processes.COMPOSE_RESTARTS`: a process that exits, however it ends, is
    started again, and what it started dies with it). Stores and one log per process go under
    ``data_dir/name``; ``procs`` stops the stack at the end."""
    from libs.models.tiny import make_tiny

    root = data_dir / name.replace(" ", "-")
    root.mkdir(parents=True)
    stack = Stack(root, log_dir=root, note=log, name=name)
    procs.stoppers.append(stack.stop)
    log(f"starting {name}: one process per service")
    stack.start_nats(nats_nodes, sync_interval)
    make_tiny()
    pipeline, port = load_pipeline(pipeline_path), free_port()
    stack.start_services(plan_services(pipeline, pipeline_path, stack.nats_url, port, log_stats), port)
    log(f"{name} ready in {stack.wait_all_live(pipeline):.1f} s")
    stack.supervise(COMPOSE_RESTARTS)
    return stack


CHUNK_COLUMNS = (
    "audio whole / judged",
    "audio chunks",
    "missing",
    "repeated",
    "unlike whole decode",
    "talker input unlike thinker tokens",
    "re-sent (unlike) / bus gaps",
    "reference unread (streams not judged)",
)
"""The chunk judge's columns (:class:`AudioTally`), added when a row has them."""


def _chunk_cells(t: AudioTally | None) -> tuple[str, ...]:
    if t is None:
        return ("-",) * len(CHUNK_COLUMNS)
    return (
        f"{t.whole} / {t.streams}",
        str(t.expected),
        str(t.missing),
        str(t.repeated),
        str(t.unlike),
        str(t.input_unlike),
        f"{t.resent} ({t.resent_unlike}) / {t.gaps}",
        f"{t.unread} ({t.unjudged})",
    )


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
    judged = any(r.chunks is not None for r in rows)
    if judged:
        head += CHUNK_COLUMNS
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
        if judged:
            cells += _chunk_cells(r.chunks)
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(f"| {line} |" for line in lines)


def run_fault_suite(
    only: str | None = None, keep_logs: bool = False, mode: str = "up", pipeline_name: str = "tiny"
) -> int:
    """Start the stacks the selected faults of ``pipeline_name`` (:data:`PIPELINES`) need (every
    fault, or those whose name contains ``only``) the way ``mode`` says (:data:`MODES`), run the
    faults in order, print the table (and, with ``keep_logs``, where the stacks' logs are). Exit
    status 1, the logs kept, when a row did not pass (:func:`passed`) or a stack failed; else 0."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    from libs.models.tiny import resolve_model

    spec = pipelines()[pipeline_name]
    rows: list[Row] = []
    failing: list[str] = []
    selected = [f for f in spec.faults if not only or only in f.name]
    judge = ChunkJudge(PIPELINE_NAME, resolve_model(spec.codec_model)) if spec.judge_chunks else None

    def work(procs: Processes, data_dir: Path) -> None:
        pipeline = data_dir / "faults.yaml"
        pipeline.write_text(spec.yaml)
        for nodes in sorted({f.nats_nodes for f in selected}):
            name = "faults" if nodes == 1 else f"faults-{nodes}-node-nats"
            if mode == "services":
                stack = start_services(procs, name, pipeline, data_dir, nats_nodes=nodes)
            else:
                stack = start_stack(procs, name, pipeline, {}, data_dir, ["--log-stats"], nats_nodes=nodes)
            injector = Injector(stack, spec.stage_names)
            for fault in (f for f in selected if f.nats_nodes == nodes):
                rows.append(asyncio.run(run_fault(injector, fault, MODEL, judge)))
                log(render(rows[-1:]).splitlines()[-1])
                if not passed(fault, rows[-1]):
                    failing.append(fault.name)
            stack.stop()  # the next stack gets the machine to itself
        if failing:  # run_with_stacks keeps the logs and the command exits 1
            raise RuntimeError(f"{len(failing)} row(s) did not pass: {'; '.join(failing)}")

    code = run_with_stacks("omnirelay-faults-", work, keep=keep_logs)
    print(f"fault suite, pipeline {pipeline_name}, mode {mode}")
    print(render(rows))
    return code
