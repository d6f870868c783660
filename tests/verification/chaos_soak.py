"""``omnirelay verify chaos``: the chaos soak. The fault suite's stack (an ``omnirelay up`` stack
with two replicas of every stage and a NATS server of its own) serves a continuous mixed load —
text and audio, streamed and not, 32 to 800 tokens, a fixed number of requests in flight — for
``--minutes``, while a fault drawn at random from the fault suite's list strikes every 20–40 s.
Each injection is verified (:class:`tests.verification.fault_injection.Injector`), and the next fault
does not wait for the last one's victim to come back: faults overlap, but none takes the last
live replica of a stage (the fault that kills every thinker replica at once is drawn only with
``--all-replicas``; the 3-node cluster's faults are left out, they need a stack of their own).

Ground truth: before the load, the fault-free greedy response of every (prompt, max_tokens,
audio) the load sends is taken once, streamed; a completed request must have the same token ids
and text, ``max_tokens`` tokens (``ignore_eos``) and, with audio, as many bytes of audio in as
many chunks (streamed) as its reference. The accounting is :mod:`tests.verification.chaos_accounting`.

Clocks: ``time.monotonic()`` of this process, seconds (the registry's ``started_ns`` is compared
with this host's wall clock, ``time.time_ns()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.chat_streams import MODEL, TWO_REPLICA_PIPELINE, Seen, send
from benchmarks.harness import PROMPTS, Processes, log, run_with_stacks, start_stack
from tests.verification.chaos_accounting import (
    Account,
    Ask,
    Record,
    Strike,
    account,
    explain,
    lost_or_hung,
    render,
)
from tests.verification.fault_injection import (
    CLUSTER_NODE_TARGETS,
    FAULTS,
    REPLICAS,
    STAGE_NAMES,
    Fault,
    Injection,
    Injector,
    health,
    healthy,
    pids_of,
    proc_state,
    replaced,
    until_back,
)
from tests.verification.fault_suite import PROMPT, reference

SOAK_PROMPTS = (PROMPT, PROMPTS[0])
TEXT_TOKENS = (32, 200, 800)
"""``max_tokens`` of the text requests."""
AUDIO_TOKENS = (32, 200)
"""``max_tokens`` of the audio requests (200 text tokens are 800 codec codes, 16 s of audio)."""
ASKS = tuple(
    Ask(prompt, n, audio, stream)
    for prompt in SOAK_PROMPTS
    for audio, lengths in ((False, TEXT_TOKENS), (True, AUDIO_TOKENS))
    for n in lengths
    for stream in (True, False)
)
"""The load's mix: each request is one of these, drawn uniformly."""
CONCURRENCY = 6
"""Requests in flight at any time (by default)."""
INTERVAL_S = (20.0, 40.0)
"""A fault strikes this long after the last one (drawn uniformly), seconds."""
HUNG_AFTER_S = 150.0
"""A request not ended this long after it was sent is hung (the deadline is 120 s), seconds."""
BACK_WITHIN_S = 300.0
"""A fault's victim not back this long after it ends (SIGCONT, restart) stays down for the
rest of the soak (its stage gets no further fault), seconds."""
FAILED_PAUSE_S = 1.0
"""A client waits this long after a failed request before its next one, seconds."""
SOAK_FAULTS = tuple(
    f
    for f in FAULTS
    if f.target not in ("all_replicas", *CLUSTER_NODE_TARGETS) and not (f.target == "nats" and f.audio)
)
"""The faults drawn: every fault of the suite but the cluster's, the broker's second row (the same
fault, judged on audio streams) and, unless asked for, the one that kills every replica of a stage."""
ALL_REPLICAS_FAULTS = tuple(f for f in FAULTS if f.target == "all_replicas")


def victims(fault: Fault, replica: int) -> list[str]:
    """What a fault takes down, by name: ``thinker-1``, ``orchestrator``, ``nats-server``."""
    if fault.target == "orchestrator":
        return ["orchestrator"]
    if fault.target == "nats":
        return ["nats-server"]
    replicas = range(REPLICAS) if fault.target == "all_replicas" else [replica]
    return [f"{STAGE_NAMES[fault.stage]}-{r}" for r in replicas]


@dataclass
class Pending:
    """A fault injected, while the soak runs (becomes a :class:`Strike`)."""

    name: str
    at_s: float
    during: str
    until_s: float | None = None
    injection: Injection | None = None

    def strike(self) -> Strike:
        done = self.injection or Injection("not verified by the end of the soak", False)
        return Strike(self.name, self.at_s, self.until_s, done.verified, done.took, self.during)


@dataclass
class Soak:
    """The soak's state: the load's records, the faults injected, the victims not back yet."""

    injector: Injector
    client: object
    """The ``openai.AsyncOpenAI`` client of the load."""
    references: dict[tuple[str, int, bool], Seen]
    records: list[Record] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    """Victims (:func:`victims`) of faults not over yet."""
    injecting: set[asyncio.Task] = field(default_factory=set)
    watching: set[asyncio.Task] = field(default_factory=set)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def candidates(self, fault: Fault) -> list[int]:
        """The replicas ``fault`` may strike now (``[0]`` for a fault without one; empty: none):
        its victim must be up, and a stage keeps a live replica unless the fault is the one that
        kills every replica (drawn only when none is down)."""
        names = [victims(fault, r) for r in range(REPLICAS)]
        if fault.target in ("orchestrator", "nats", "all_replicas"):
            return [] if self.down & set(names[0]) else [0]
        stage = {n for vs in names for n in vs}
        if len(stage & self.down) + 1 >= REPLICAS:
            return []
        return [r for r in range(REPLICAS) if not set(names[r]) & self.down]

    async def user(self, rng: random.Random) -> None:
        """One client: a request at a time, drawn from :data:`ASKS`, until the soak stops."""
        while not self.stopping.is_set():
            ask = rng.choice(ASKS)
            seen = Seen()
            self.records.append(Record(ask, seen))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HUNG_AFTER_S):
                    await send(self.client, MODEL, seen, ask.prompt, ask.max_tokens, ask.audio, ask.stream)
            if seen.ended_s is None:
                log(
                    f"request {seen.id or '(no id yet)'} hung: not ended {HUNG_AFTER_S:.0f} s after it was sent"
                )
            elif seen.error is not None:
                await asyncio.sleep(FAILED_PAUSE_S)

    def strike(self, fault: Fault, replica: int) -> None:
        """Inject ``fault`` now (in a task: a ``SIGSTOP`` holds for 30 s) and watch its victim
        come back; the victims count as down until then."""
        names = victims(fault, replica)
        label = f"{fault.name} [{', '.join(names)}]"
        p = Pending(label, time.monotonic(), ", ".join(sorted(self.down)))
        self.pending.append(p)
        self.down.update(names)
        task = asyncio.create_task(self._inject(p, fault, replica, names))
        self.injecting.add(task)
        task.add_done_callback(self.injecting.discard)

    async def _inject(self, p: Pending, fault: Fault, replica: int, names: list[str]) -> None:
        before_ns = time.time_ns()  # a replacement registers with a later started_ns
        try:
            p.injection = await self.injector.inject(fault, replica)
        except Exception as e:  # its process was not found (restarting on its own, ...): said in the row
            p.injection = Injection(f"not injected: {type(e).__name__}: {e}", False)
        log(f"{p.name}: {'verified' if p.injection.took else 'NOT VERIFIED'} ({p.injection.verified})")
        if not p.injection.pids:  # nothing was signalled: nothing to come back
            p.until_s = time.monotonic()
            self.down.difference_update(names)
            return
        task = asyncio.create_task(self._watch(p, fault, replica, names, before_ns))
        self.watching.add(task)
        task.add_done_callback(self.watching.discard)

    async def _watch(self, p: Pending, fault: Fault, replica: int, names: list[str], before_ns: int) -> None:
        try:
            await self._back(fault, replica, p.injection, before_ns)
        except RuntimeError as e:
            log(f"{p.name}: {e}; its stage gets no further fault")
            return
        p.until_s = time.monotonic()
        self.down.difference_update(names)
        log(f"{p.name}: over after {p.until_s - p.at_s:.1f} s")

    async def _back(self, fault: Fault, replica: int, done: Injection, before_ns: int) -> None:
        """Return once the victim of ``fault`` is back: a killed worker's (or one that gave up on
        its engine) replacement registered; a stopped one, continued, live in ``/health`` again;
        the orchestrator restarted and live; the broker reconnected to."""
        stack = self.injector.stack
        if fault.target == "all_replicas":
            for r in range(REPLICAS):
                await replaced(stack, fault.stage, r, before_ns, BACK_WITHIN_S)
            return
        if fault.target in ("worker", "engine_core"):
            if fault.sig == signal.SIGKILL or proc_state(done.pids[0]) in ("gone", "Z"):
                await replaced(stack, fault.stage, replica, before_ns, BACK_WITHIN_S)
                return
            stage = f"{fault.stage}:{STAGE_NAMES[fault.stage]}"
            await _until(lambda h: h["stages"].get(stage, 0) >= REPLICAS, stack, f"{stage} live again")
            return
        if fault.target == "orchestrator":
            root = stack.root_pid
            await _until(
                lambda h: (
                    bool(set(pids_of(root, "-m cli orchestrator")) - set(done.pids))
                    and h["orchestrators"] > 0
                ),
                stack,
                "a new orchestrator",
            )
            return
        await _until(lambda h: bool(h["bus"]), stack, "the gateway on the broker again")

    async def inject_until(self, stop_s: float, rng: random.Random, faults: tuple[Fault, ...]) -> None:
        """Strike a fault every :data:`INTERVAL_S` until ``stop_s`` (``time.monotonic()``): drawn
        from the faults that have a candidate victim now, its victim drawn among those."""
        next_s = time.monotonic() + rng.uniform(*INTERVAL_S)
        while next_s < stop_s:
            await asyncio.sleep(max(next_s - time.monotonic(), 0.0))
            possible = [(f, c) for f in faults if (c := self.candidates(f))]
            if possible:
                fault, replicas = rng.choice(possible)
                self.strike(fault, rng.choice(replicas))
            else:
                log(f"no fault has a victim now (down: {', '.join(sorted(self.down))}); skipped")
            next_s += rng.uniform(*INTERVAL_S)
        await asyncio.sleep(max(stop_s - time.monotonic(), 0.0))


async def _until(check, stack, what: str) -> None:
    """Poll the gateway's ``/health`` every second until ``check(body)`` holds (an unreadable
    answer is asked again); RuntimeError after :data:`BACK_WITHIN_S`."""

    async def holds() -> bool:
        with contextlib.suppress(Exception):
            return bool(check(await health(stack)))
        return False

    await until_back(holds, what, BACK_WITHIN_S)


async def take_references(client, concurrency: int) -> dict[tuple[str, int, bool], Seen]:
    """The fault-free greedy response (streamed) of every (prompt, max_tokens, audio) of
    :data:`ASKS`, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key: tuple[str, int, bool]) -> tuple[tuple[str, int, bool], Seen]:
        async with gate:
            return key, await reference(client, MODEL, *key, stream=True)

    refs = dict(await asyncio.gather(*(one(k) for k in sorted({a.key for a in ASKS}))))
    for (_, n, audio), seen in refs.items():
        if len(seen.token_ids) != n:
            log(f"warning: the fault-free reference of {n} tokens (audio {audio}) has {len(seen.token_ids)}")
    return refs


async def soak(
    injector: Injector, minutes: float, seed: int, concurrency: int, faults: tuple[Fault, ...]
) -> tuple[Account, float]:
    """Run the soak on ``injector``'s stack; (its account, the load's start as ``time.monotonic()``)."""
    from openai import AsyncOpenAI

    await healthy(injector.stack)
    client = AsyncOpenAI(
        base_url=injector.stack.api_url, api_key="unused", max_retries=0, timeout=HUNG_AFTER_S + 30
    )
    refs = await take_references(client, concurrency)
    log(f"took {len(refs)} fault-free references; load: {concurrency} in flight for {minutes:g} min")
    s = Soak(injector, client, refs)
    load_rng, fault_rng = random.Random(f"{seed}-load"), random.Random(f"{seed}-faults")
    t0 = time.monotonic()
    users = [asyncio.create_task(s.user(load_rng)) for _ in range(concurrency)]
    await s.inject_until(t0 + 60.0 * minutes, fault_rng, faults)
    s.stopping.set()
    log(f"stopped injecting; waiting for the {sum(not t.done() for t in users)} requests in flight")
    await asyncio.wait(users)  # each is bounded by HUNG_AFTER_S
    if s.injecting:  # a SIGSTOP's SIGCONT, a broker coming back
        await asyncio.wait(s.injecting)
    for task in list(s.watching):
        task.cancel()
    end_s = time.monotonic()
    await client.close()
    strikes = [p.strike() for p in s.pending]
    for line in filter(None, (explain(r, refs[r.ask.key]) for r in s.records)):
        log(f"not right: {line}")
    return account(strikes, s.records, refs, HUNG_AFTER_S, end_s), t0


def run_chaos_soak(
    minutes: float,
    seed: int = 0,
    concurrency: int = CONCURRENCY,
    all_replicas: bool = False,
    keep_logs: bool = False,
) -> int:
    """Start the stack, soak it for ``minutes`` with a fault every 20–40 s (``seed`` fixes the
    draws), print the table. Exit status 1, the logs kept, when a request hung or came back with
    tokens or audio missing or repeated, when an injection was not verified, or when the stack
    failed; else 0."""
    faults = SOAK_FAULTS + (ALL_REPLICAS_FAULTS if all_replicas else ())
    results: list[tuple[Account, float]] = []

    def work(procs: Processes, data_dir: Path) -> None:
        pipeline = data_dir / "faults.yaml"
        pipeline.write_text(TWO_REPLICA_PIPELINE)
        stack = start_stack(procs, "chaos", pipeline, {}, data_dir, ["--log-stats"])
        results.append(asyncio.run(soak(Injector(stack), minutes, seed, concurrency, faults)))
        stack.stop()
        acc = results[0][0]
        if lost_or_hung(acc) or any(not s.took for s, _ in acc.rows):  # run_with_stacks keeps the logs
            raise RuntimeError("a request hung or lost or repeated tokens or audio, or an injection failed")

    code = run_with_stacks("omnirelay-chaos-", work, keep=keep_logs)
    if results:
        acc, t0 = results[0]
        print(f"chaos soak: {minutes:g} min, seed {seed}, {concurrency} in flight, a fault every 20–40 s")
        print(render(acc, t0))
    return code
