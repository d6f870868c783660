"""``omnirelay bench profile``: where the CPU of a streamed token goes (issue 23 item 2).

The stack is the mock-engine text pipeline (``compose/pipelines/mock-text.yaml``, started as
``omnirelay bench capacity`` starts it: :func:`benchmarks.harness.start_stack` with
:func:`benchmarks.frontend_capacity.stack_env`), so no model computes and every per-token step of
omnirelay runs. Per concurrency level, streamed chat completions (the official openai client,
``--max-tokens`` each, ``ignore_eos``) are driven by a client process (the load code of
``bench capacity``, :func:`benchmarks.frontend_capacity.client_job`) while ``py-spy record
--format raw --rate R --pid P`` samples the gateway's and the thinker worker's Python stacks.
py-spy drops samples of idle threads, so a process's samples × the interval (1/R s) approximate
the time its threads ran Python (or native code called from it); the process's CPU over the
same window (:func:`benchmarks.process_table.process_cpu_s`) is printed beside it as a check.

The samples are folded (:func:`fold`, pure) into frame groups (:data:`GROUPS`): each sample
belongs to the first group, in the list's order, one of whose rules matches any frame of its
stack. Specific work (logging, decode, encode, rendering, fences) comes first and the frameworks
that are merely ancestors of it (uvicorn, nats-py's subscription tasks, asyncio) come last, so a
group holds the work done by or under its frames and not claimed by a group before it.

Units: ``interval_s`` seconds; ``us_per_token`` microseconds of sampled time per output token
(samples × interval ÷ output tokens of the level's requests).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.frontend_capacity import MOCK_PIPELINE, _roles, client_job, stack_env
from benchmarks.harness import Processes, log, percentile, run_with_stacks, start_stack
from benchmarks.process_table import process_cpu_s
from libs.common.pipeline import load_pipeline

# --- folding (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One Python frame of a py-spy sample: its function and file (as py-spy printed it)."""

    function: str
    file: str

    @property
    def label(self) -> str:
        """``function (last two parts of the file's path)``."""
        return f"{self.function} ({'/'.join(self.file.split('/')[-2:])})"


@dataclass(frozen=True)
class Rule:
    """Matches a frame whose file path contains ``path`` and, if ``functions`` is not empty,
    whose function is one of them: py-spy qualifies names (``Client._flusher``,
    ``ResponseTimer.__call__.<locals>.timed_send``), so a name matches its last dotted parts."""

    path: str
    functions: tuple[str, ...] = ()
    leaf: bool = False
    """Match only the sample's leaf frame (the function's own time): for middlewares and the like,
    which are ancestors of all the work under them."""

    def matches(self, frame: Frame) -> bool:
        """True when ``frame`` is one this rule names (``leaf`` is checked by :class:`Group`)."""
        if self.path not in frame.file:
            return False
        f = frame.function
        return not self.functions or any(f == name or f.endswith("." + name) for name in self.functions)


@dataclass(frozen=True)
class Group:
    """A named share of the per-token path: the samples with a frame any of ``rules`` matches
    (and none of an earlier group's)."""

    name: str
    rules: tuple[Rule, ...]

    def matches(self, stack: Sequence[Frame]) -> bool:
        """True when a frame of ``stack`` matches one of the rules (a ``leaf`` rule: its last)."""
        return any(r.matches(f) for r in self.rules for f in (stack[-1:] if r.leaf else stack))


OTHER = "other"
"""The group of a sample no group's rule matches."""
EVENT_LOOP = "event loop (uvloop/asyncio, tasks, selectors)"
"""The group of the event loop's own time (also: samples whose leaf is where the loop runs)."""
LOOP_ENTRY = Rule("asyncio/runners.py")
"""Where a service's event loop runs (``asyncio.run``/``uvloop.run`` → ``Runner.run``): py-spy
puts the running task's coroutine frames right under it, so the frames above it (the command
line, ``uvicorn.run``, the service's ``main``) are ancestors of every sample and are cut off
before grouping."""

GROUPS: tuple[Group, ...] = (
    Group("logging", (Rule("/logging/"), Rule("libs/common/logs.py"))),
    Group(
        "metrics / tracing",
        (
            Rule("prometheus_client/"),
            Rule("prometheus_fastapi_instrumentator/metrics.py"),
            Rule("prometheus_fastapi_instrumentator/middleware.py", leaf=True),
            Rule("opentelemetry/"),
            Rule("libs/common/tracing.py"),
            Rule("gateway/request_stats.py"),
            Rule("stage_worker/engine_metrics.py"),
            Rule("stage_worker/transfer_stats.py"),
        ),
    ),
    Group(
        "event decode (msgpack + pydantic validate)",
        (
            Rule("libs/common/envelopes.py", ("decode", "decode_or_log")),
            Rule("msgpack/", ("unpackb",)),
        ),
    ),
    Group(
        "event encode (pydantic dump + msgpack)",
        (
            Rule("libs/common/envelopes.py", ("encode",)),
            Rule("msgpack/", ("packb",)),
        ),
    ),
    Group(
        "SSE chunk rendering (routes: pydantic chunk → JSON)",
        (
            Rule("gateway/routes.py", ("_chat_render", "_chat_chunk", "_chat_tail")),
            Rule("gateway/routes.py", ("_completion_render", "_completion_chunk", "_completion_tail")),
            Rule("gateway/responses.py", ("sse",)),
            Rule("gateway/schemas.py"),
        ),
    ),
    Group(
        "detokenizing / stop strings",
        (
            Rule("tokenizers/"),
            Rule("transformers/"),
            Rule("vllm/"),
            Rule("stage_worker/mock_engine.py", ("_detokenizer",)),
            Rule("stage_worker/resumed_text.py"),
            Rule("stage_worker/chunking.py"),
        ),
    ),
    Group("asyncio.timeout (enter/exit)", (Rule("asyncio/timeouts.py"),)),
    Group("asyncio.Queue put/get", (Rule("asyncio/queues.py"),)),
    Group(
        "HTTP write/read (uvicorn send/receive, h11)",
        (
            Rule("uvicorn/protocols/http/", ("RequestResponseCycle.send", "RequestResponseCycle.receive")),
            Rule("h11/"),
        ),
    ),
    Group(
        "nats-py publish (write, flush)",
        (Rule("nats/aio/client.py", ("publish", "_send_command", "_flush_pending", "_flusher")),),
    ),
    Group(
        "handle: fences, ordering, trust checks",
        (Rule("gateway/request_handle.py"), Rule("gateway/event_trust.py")),
    ),
    Group("client-event delivery (kept until confirmed)", (Rule("stage_worker/client_stream.py"),)),
    Group(
        "ResponseTimer and middlewares (own code)",
        (
            Rule("gateway/app.py", ("timed_send",)),
            Rule("gateway/app.py", ("ResponseTimer.__call__",), leaf=True),
            Rule("gateway/limits.py", ("SlotRelease.__call__",), leaf=True),
            Rule("gateway/request_size.py", ("RequestSizeLimit.__call__",), leaf=True),
        ),
    ),
    Group(
        "request admission (once per request: body, prompt, auth, limits, submit)",
        (
            Rule("gateway/submission.py"),
            Rule("gateway/prompting.py"),
            Rule("gateway/auth.py"),
            Rule("gateway/limits.py"),
            Rule("gateway/request_size.py"),
            Rule("fastapi/dependencies/"),
            Rule("starlette/requests.py"),
        ),
    ),
    Group(
        "gateway event intake (pipeline_client)",
        (Rule("gateway/pipeline_client.py"),),
    ),
    Group(
        "gateway SSE stream (responses.py, routes.py)",
        (Rule("gateway/responses.py"), Rule("gateway/routes.py")),
    ),
    Group(
        "worker publish path (request_context, publish)",
        (Rule("stage_worker/request_context.py"), Rule("libs/common/publish.py")),
    ),
    Group(
        "engine output loop (handler + mock engine)",
        (
            Rule("stage_worker/handlers/"),
            Rule("stage_worker/mock_engine.py"),
            Rule("stage_worker/llm_engine.py"),
            Rule("stage_worker/progress.py"),
            Rule("stage_worker/worker.py"),
            Rule("stage_worker/inbox.py"),
        ),
    ),
    Group(
        "HTTP framework (uvicorn, starlette, fastapi: parsing, routing, streaming)",
        (
            Rule("uvicorn/"),
            Rule("starlette/"),
            Rule("fastapi/"),
            Rule("anyio/"),
            Rule("gateway/http_protocol.py"),
            Rule("gateway/app.py"),
            Rule("prometheus_fastapi_instrumentator/"),
        ),
    ),
    Group("nats-py read loop + subscription tasks", (Rule("nats/"),)),
    Group(EVENT_LOOP, (Rule("asyncio/"), Rule("uvloop/"), Rule("selectors.py"))),
)
"""The frame groups, most specific first (see the module's docstring)."""

_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def parse_raw(text: str) -> list[tuple[tuple[Frame, ...], int]]:
    """The samples of py-spy's ``--format raw`` output: one ``(stack root → leaf, count)`` per
    line (``frame;frame;… count``, each frame ``function (file:line)``). Frames py-spy prints
    without a file (``process …``, ``thread …``) are kept with an empty file."""
    out: list[tuple[tuple[Frame, ...], int]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:120]!r}")
        frames = []
        for part in stack_text.split(";"):
            m = _FRAME.match(part)
            frames.append(Frame(m["function"], m["file"]) if m else Frame(part, ""))
        out.append((tuple(frames), int(count)))
    return out


def work_frames(stack: Sequence[Frame]) -> Sequence[Frame]:
    """The frames of ``stack`` under its last :data:`LOOP_ENTRY` frame (all of them if it has
    none)."""
    entries = [i for i, f in enumerate(stack) if LOOP_ENTRY.matches(f)]
    return stack[entries[-1] + 1 :] if entries else stack


def group_of(stack: Sequence[Frame], groups: Sequence[Group] = GROUPS) -> str:
    """The name of the first of ``groups`` that matches the :func:`work_frames` of ``stack``;
    :data:`EVENT_LOOP` when the loop's entry is the leaf (the loop's own code, uvloop's C);
    else :data:`OTHER`."""
    work = work_frames(stack)
    if not work and stack:
        return EVENT_LOOP
    return next((g.name for g in groups if g.matches(work)), OTHER)


@dataclass(frozen=True)
class Share:
    """One row of a profile table."""

    name: str
    samples: int
    pct: float
    """Percent of the process's samples."""
    us_per_token: float
    """Sampled microseconds per output token."""


@dataclass(frozen=True)
class Profile:
    """One process at one concurrency, folded."""

    samples: int
    interval_s: float
    tokens: int
    groups: list[Share]
    """Every group with samples, most first."""
    functions: list[Share]
    """Functions by self samples (the leaf frame), most first."""

    @property
    def us_per_token(self) -> float:
        """All sampled microseconds per output token."""
        return self.samples * self.interval_s * 1e6 / self.tokens if self.tokens else 0.0


def fold(
    samples: Iterable[tuple[Sequence[Frame], int]],
    interval_s: float,
    tokens: int,
    groups: Sequence[Group] = GROUPS,
    top_functions: int = 10,
) -> Profile:
    """Fold py-spy samples into a :class:`Profile`: per group and per leaf function, the samples,
    their percent of all and their microseconds per output token (samples × ``interval_s`` ×
    1e6 ÷ ``tokens``; 0 when ``tokens`` is 0). Only the ``top_functions`` costliest functions are
    kept."""
    by_group: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    total = 0
    for stack, n in samples:
        total += n
        by_group[group_of(stack, groups)] += n
        if stack:
            by_function[stack[-1].label] += n

    def share(name: str, n: int) -> Share:
        return Share(
            name=name,
            samples=n,
            pct=100.0 * n / total if total else 0.0,
            us_per_token=n * interval_s * 1e6 / tokens if tokens else 0.0,
        )

    return Profile(
        samples=total,
        interval_s=interval_s,
        tokens=tokens,
        groups=[share(k, n) for k, n in by_group.most_common()],
        functions=[share(k, n) for k, n in by_function.most_common(top_functions)],
    )


def render_profile(title: str, p: Profile, cpu_us_per_token: float | None, top_groups: int = 10) -> str:
    """A Markdown table of ``p``'s top groups and one of its costliest functions. With
    ``cpu_us_per_token`` (the process's CPU per token, the kernel's CPU clock) a column gives each row's share of
    it: the sampled time includes time the GIL holder waited for a core, the CPU does not."""
    cpu = (
        f"; CPU read from the kernel: {cpu_us_per_token:.0f} µs/token" if cpu_us_per_token is not None else ""
    )

    def cpu_col(pct: float) -> str:
        return f" {pct / 100 * cpu_us_per_token:.1f} |" if cpu_us_per_token is not None else ""

    extra_head, extra_rule = (
        (" share × CPU, µs / token |", " ---: |") if cpu_us_per_token is not None else ("", "")
    )
    lines = [
        f"#### {title}",
        "",
        f"{p.samples} samples × {p.interval_s * 1e3:.0f} ms over {p.tokens} output tokens = "
        f"{p.us_per_token:.0f} µs sampled per token{cpu}",
        "",
        f"| group | samples | share | sampled µs / token |{extra_head}",
        f"| --- | ---: | ---: | ---: |{extra_rule}",
    ]
    lines += [
        f"| {s.name} | {s.samples} | {s.pct:.1f} % | {s.us_per_token:.1f} |{cpu_col(s.pct)}"
        for s in p.groups[:top_groups]
    ]
    rest = p.groups[top_groups:]
    if rest:
        n, pct = sum(s.samples for s in rest), sum(s.pct for s in rest)
        lines.append(
            f"| ({len(rest)} more) | {n} | {pct:.1f} % | {sum(s.us_per_token for s in rest):.1f} |{cpu_col(pct)}"
        )
    lines += [
        "",
        f"| function (self samples) | samples | share | sampled µs / token |{extra_head}",
        f"| --- | ---: | ---: | ---: |{extra_rule}",
    ]
    lines += [
        f"| `{s.name}` | {s.samples} | {s.pct:.1f} % | {s.us_per_token:.1f} |{cpu_col(s.pct)}"
        for s in p.functions
    ]
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileOptions:
    """What ``omnirelay bench profile`` runs (see the CLI for meanings)."""

    pipeline_path: Path = MOCK_PIPELINE
    concurrency: tuple[int, ...] = (1, 16)
    seconds: float = 20.0
    """Roughly how long each level's load (and recording) lasts, seconds."""
    max_tokens: int = 64
    rate: int = 200
    """py-spy samples per second."""
    gil: bool = True
    """Sample only the thread holding the GIL (py-spy ``--gil``): the Python CPU of the process.
    py-spy's idle detection does not work in this container (threads blocked in ``select`` or a
    queue are sampled as busy), so without it waiting is counted as work."""
    warmup: int = 32
    out_dir: Path | None = None
    """Where the raw py-spy files and the tables go (kept); None: only printed."""
    json_path: Path | None = None


@dataclass
class LevelResult:
    """One concurrency level: its load and, per role, the folded profile and its CPU."""

    concurrency: int
    requests: int
    errors: int
    tokens: int
    wall_s: float
    tpot_p50_ms: float | None = None
    """Client-side TPOT p50 of the level's requests, milliseconds."""
    profiles: dict[str, Profile] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)


def _py_spy() -> str:
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        raise RuntimeError(f"py-spy not found beside {sys.executable} (pip install py-spy)")
    return str(exe)


def _wait_sampling(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Return once py-spy says it is sampling (it prints so after attaching)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        if "Sampling process" in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"py-spy exited ({proc.returncode}): {text[-600:]}")
        time.sleep(0.05)
    raise RuntimeError(f"py-spy did not start sampling within {timeout_s:.0f} s")


def _level(
    opts: ProfileOptions,
    c: int,
    url: str,
    model: str,
    pids: dict[str, int],
    pool: ProcessPoolExecutor,
    work: Path,
) -> LevelResult:
    # The rate of this level, from a short unrecorded run, sets how many requests fill --seconds.
    t0 = time.monotonic()
    calib = pool.submit(client_job, [url], model, max(2 * c, 8), c, opts.max_tokens, 0).result()
    rate = len(calib) / max(time.monotonic() - t0, 1e-3)
    requests = max(c, math.ceil(rate * opts.seconds))
    spies: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for role, pid in pids.items():
            raw, err = work / f"c{c}-{role}.raw.txt", work / f"c{c}-{role}.py-spy.log"
            argv = [_py_spy(), "record", "--pid", str(pid), "--rate", str(opts.rate)]
            argv += ["--format", "raw", "--full-filenames", "-o", str(raw), *(["--gil"] if opts.gil else [])]
            with err.open("w") as fh:
                spies[role] = (subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT), raw)
            _wait_sampling(spies[role][0], err, 30)
        cpu0 = {role: process_cpu_s(pid) for role, pid in pids.items()}
        w0 = time.monotonic()
        timings = pool.submit(client_job, [url], model, requests, c, opts.max_tokens, 0).result()
        wall = time.monotonic() - w0
        cpu = {role: process_cpu_s(pid) - cpu0[role] for role, pid in pids.items()}
    finally:
        for proc, _ in spies.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for proc, _ in spies.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    good = [t for t in timings if t.ok]
    tokens = sum(t.tokens for t in good)
    tpots = [t.tpot_s for t in good if t.tpot_s is not None]
    tpot = percentile(tpots, 50) * 1e3 if tpots else None
    result = LevelResult(c, len(timings), len(timings) - len(good), tokens, wall, tpot, cpu_s=cpu)
    for role, (_, raw) in spies.items():
        if not raw.exists():
            raise RuntimeError(
                f"py-spy wrote no {raw.name}: {raw.with_suffix('').with_suffix('.py-spy.log')}"
            )
        result.profiles[role] = fold(parse_raw(raw.read_text()), 1.0 / opts.rate, tokens)
    log(
        f"c={c}: {result.requests} requests ({result.errors} failed), {tokens} tokens in {wall:.1f} s; "
        + ", ".join(f"{r} {p.samples} samples" for r, p in result.profiles.items())
    )
    return result


def box_state() -> str:
    """When and on what: the UTC time, the usable cores and the load average (one line)."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"{when}; {len(os.sched_getaffinity(0))} usable cores, load average {load}"


def render(results: Sequence[LevelResult]) -> str:
    """Every level's tables (Markdown)."""
    out = []
    for r in results:
        out.append(
            f"### c = {r.concurrency}: {r.requests} requests ({r.errors} failed), {r.tokens} output tokens, "
            f"{r.wall_s:.1f} s, {r.tokens / r.wall_s:.0f} tokens/s"
            + (f", TPOT p50 {r.tpot_p50_ms:.2f} ms" if r.tpot_p50_ms is not None else "")
        )
        for role, p in r.profiles.items():
            cpu = r.cpu_s.get(role)
            per_token = cpu * 1e6 / r.tokens if cpu is not None and r.tokens else None
            out += ["", render_profile(f"{role}, c = {r.concurrency}", p, per_token)]
        out.append("")
    return "\n".join(out)


def run_profile_bench(opts: ProfileOptions) -> int:
    """Start the mock stack, record each level, print the tables; 0 on success, 1 on failure."""
    pipeline = load_pipeline(opts.pipeline_path)
    model = pipeline.served_model_name

    def work(procs: Processes, data_dir: Path) -> None:
        started = box_state()
        stack = start_stack(procs, "mock stack", opts.pipeline_path, stack_env(opts.concurrency), data_dir)
        roles = _roles(stack, [], None, [])
        pids = {role: roles[role][0] for role in ("gateway-1", "worker") if role in roles}
        if set(pids) != {"gateway-1", "worker"} or len(roles.get("worker", [])) != 1:
            raise RuntimeError(f"expected one gateway and one worker under omnirelay up, got {roles}")
        pids = {"gateway": pids["gateway-1"], "worker": pids["worker"]}
        out_dir = opts.out_dir or data_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            warm = pool.submit(
                client_job, [stack.base_url], model, opts.warmup, 8, opts.max_tokens, 0
            ).result()
            if any(not t.ok for t in warm):
                raise RuntimeError(f"warm-up failed: {next(t.error for t in warm if not t.ok)}")
            results = [_level(opts, c, stack.base_url, model, pids, pool, out_dir) for c in opts.concurrency]
        text = f"started {started}; ended {box_state()}\n\n{render(results)}"
        print(text, flush=True)
        if opts.out_dir:
            (out_dir / "profile.md").write_text(text)
            log(f"raw py-spy files and profile.md in {out_dir}")
        if opts.json_path:
            opts.json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))

    return run_with_stacks("omnirelay-profile-", work)
