"""``omnirelay bench profile``: where the CPU of a streamed token goes, per process.

The stack is ``bench capacity``'s: ``omnirelay up`` on the mock-engine text pipeline
(``compose/pipelines/mock-text.yaml``), so no model computes and every per-token step of omnirelay
runs. Per concurrency level a client process (:func:`benchmarks.frontend_capacity.client_job`)
streams chat completions (``--max-tokens`` each, ``ignore_eos``) while ``py-spy record --format raw
--rate R --pid P`` samples the gateway's and the thinker worker's Python stacks. A process's samples
× the interval (1/R s) approximate the time its threads ran Python (or native code called from it);
its CPU over the same window (:func:`benchmarks.process_table.process_cpu_s`) is printed beside it.

The samples are folded (:func:`fold`, pure) two ways, each sample counted once in each:

- by package, of the leaf frame (its own time): omnirelay's code by module as py-spy names it
  (``services/gateway/routes.py``), anyone else's by top-level package (``asyncio``, ``pydantic``);
- by omnirelay function: the innermost frame of omnirelay's code (``services/``, ``libs/``) with
  everything it called; a sample with none is the event loop's or a framework's own.

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
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.frontend_capacity import stack_env
from benchmarks.harness import Processes, log, run_with_stacks
from benchmarks.paired import table
from benchmarks.token_cost import Sample, Side, load_side, stack_side
from libs.stack.processes import Process, wait_for

# --- folding (pure) -------------------------------------------------------------------------------

OURS = ("services/", "libs/")
"""How py-spy names the files of omnirelay's code (a file's path from its top-level package)."""
LOOP_ENTRY = "asyncio/runners.py"
"""Where a service's event loop runs (``asyncio.run``/``uvloop.run`` → ``Runner.run``): the frames
above it (the command line, ``uvicorn.run``, the service's ``main``) are ancestors of every sample."""
NOT_OURS = "(no omnirelay frame: the event loop, frameworks)"


@dataclass(frozen=True)
class Frame:
    """One Python frame of a py-spy sample: its function and file (as py-spy printed it)."""

    function: str
    file: str

    @property
    def label(self) -> str:
        return f"{self.function} ({self.file})"


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


def package_of(file: str) -> str:
    """omnirelay's code by module (``services/gateway/routes.py``), anyone else's by top-level
    package (``asyncio/queues.py`` → ``asyncio``; a lone module such as ``selectors.py`` stays)."""
    return file if file.startswith(OURS) else file.split("/")[0]


def innermost_ours(stack: Sequence[Frame]) -> str:
    """The label of the innermost frame of omnirelay's code under the last :data:`LOOP_ENTRY`
    frame of ``stack``, else :data:`NOT_OURS`."""
    entries = [i for i, f in enumerate(stack) if f.file == LOOP_ENTRY]
    work = stack[entries[-1] + 1 :] if entries else stack
    return next((f.label for f in reversed(work) if f.file.startswith(OURS)), NOT_OURS)


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
    packages: list[Share]
    """By the leaf frame's :func:`package_of`, most first."""
    functions: list[Share]
    """By :func:`innermost_ours`, most first."""

    @property
    def us_per_token(self) -> float:
        """All sampled microseconds per output token."""
        return self.samples * self.interval_s * 1e6 / self.tokens if self.tokens else 0.0


def fold(samples: Iterable[tuple[Sequence[Frame], int]], interval_s: float, tokens: int) -> Profile:
    """Fold py-spy samples into a :class:`Profile`: per package and per omnirelay function, the
    samples, their percent of all and their microseconds per output token (samples ×
    ``interval_s`` × 1e6 ÷ ``tokens``; 0 when ``tokens`` is 0)."""
    packages: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    for stack, n in samples:
        packages[package_of(stack[-1].file) if stack else ""] += n
        functions[innermost_ours(stack)] += n
    total = sum(packages.values())

    def shares(counts: Counter[str]) -> list[Share]:
        return [
            Share(k, n, 100.0 * n / total if total else 0.0, n * interval_s * 1e6 / tokens if tokens else 0.0)
            for k, n in counts.most_common()
        ]

    return Profile(total, interval_s, tokens, shares(packages), shares(functions))


def render_profile(title: str, p: Profile, cpu_us_per_token: float | None, top: int = 12) -> str:
    """Both of ``p``'s tables, their ``top`` rows and the rest summed. With ``cpu_us_per_token``
    (the process's CPU per token, the kernel's clock) a column gives each row's share of it: the
    sampled time includes time the GIL holder waited for a core, the CPU does not."""
    cpu = cpu_us_per_token
    lines = [
        f"{title}: {p.samples} samples × {p.interval_s * 1e3:.0f} ms over {p.tokens} output tokens = "
        f"{p.us_per_token:.0f} µs sampled per token"
        + (f"; CPU read from the kernel: {cpu:.0f} µs/token" if cpu is not None else "")
    ]
    for what, shares in (
        ("package (own time)", p.packages),
        ("omnirelay function (and callees)", p.functions),
    ):
        rows = shares[:top]
        if rest := shares[top:]:
            n, pct, us = (sum(getattr(s, a) for s in rest) for a in ("samples", "pct", "us_per_token"))
            rows.append(Share(f"({len(rest)} more)", n, pct, us))
        cpu_column = ["share × CPU, µs/token"] if cpu is not None else []
        header = [what, "samples", "share %", "sampled µs/token", *cpu_column]
        cells = [
            [s.name, str(s.samples), f"{s.pct:.1f}", f"{s.us_per_token:.1f}"]
            + ([f"{s.pct / 100 * cpu:.1f}"] if cpu is not None else [])
            for s in rows
        ]
        lines += ["", table(header, cells)]
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileOptions:
    """What ``omnirelay bench profile`` runs (see the CLI for meanings)."""

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
    """One concurrency level: its load (with its processes' CPU, as ``bench token-cost`` reads it)
    and, per role, the folded profile."""

    concurrency: int
    load: Sample
    profiles: dict[str, Profile] = field(default_factory=dict)


def _py_spy() -> str:
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        raise RuntimeError(f"py-spy not found beside {sys.executable} (pip install py-spy)")
    return str(exe)


def _level(
    opts: ProfileOptions, c: int, side: Side, procs: Processes, pool: ProcessPoolExecutor, work: Path
) -> LevelResult:
    # The rate of this level, from a short unrecorded run, sets how many requests fill --seconds.
    calib = load_side(pool, side, max(2 * c, 8), c, opts.max_tokens)
    requests = max(c, math.ceil(calib.requests / max(calib.wall_s, 1e-3) * opts.seconds))
    spies: dict[str, tuple[Process, Path]] = {}
    for role, (pid,) in side.roles.items():
        raw = work / f"c{c}-{role}.raw.txt"
        argv = [_py_spy(), "record", "--pid", str(pid), "--rate", str(opts.rate), "--format", "raw"]
        argv += ["-o", str(raw), *(["--gil"] if opts.gil else [])]
        spy = procs.start(f"c{c}-{role}.py-spy", argv, {}, signal.SIGINT)
        wait_for(lambda s=spy: "Sampling process" in s.text(), f"{spy.name} sampling", 30, 0.25, watch=[spy])
        spies[role] = (spy, raw)
    result = LevelResult(c, load_side(pool, side, requests, c, opts.max_tokens))
    for role, (spy, raw) in spies.items():
        spy.stop()  # py-spy writes its file on Ctrl-C
        if not raw.exists():
            raise RuntimeError(f"py-spy wrote no {raw}: {spy.log_path}")
        result.profiles[role] = fold(parse_raw(raw.read_text()), 1.0 / opts.rate, result.load.tokens)
    s = result.load
    log(
        f"c={c}: {s.requests} requests ({s.requests - s.completed} failed), {s.tokens} tokens in "
        f"{s.wall_s:.1f} s; " + ", ".join(f"{r} {p.samples} samples" for r, p in result.profiles.items())
    )
    return result


def box_state() -> str:
    """When and on what: the UTC time, the usable cores and the load average (one line)."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"{when}; {len(os.sched_getaffinity(0))} usable cores, load average {load}"


def render(results: Sequence[LevelResult]) -> str:
    """Every level's tables."""
    out = []
    for r in results:
        s = r.load
        out.append(
            f"c = {r.concurrency}: {s.requests} requests ({s.requests - s.completed} failed), {s.tokens} "
            f"output tokens, {s.wall_s:.1f} s, {s.tokens / s.wall_s:.0f} tokens/s"
            + (f", TPOT p50 {s.tpot_p50_ms:.2f} ms" if s.tpot_p50_ms is not None else "")
        )
        for role, p in r.profiles.items():
            cpu = s.cpu_us_per_token(role) if s.tokens else None
            out += ["", render_profile(f"{role}, c = {r.concurrency}", p, cpu), ""]
    return "\n".join(out)


def run_profile_bench(opts: ProfileOptions) -> int:
    """Start the mock stack, record each level, print the tables; 0 on success, 1 on failure."""

    def work(procs: Processes, data_dir: Path) -> None:
        started = box_state()
        side = stack_side(procs, "mock", None, stack_env(opts.concurrency), data_dir)
        if any(len(pids) != 1 for pids in side.roles.values()):
            raise RuntimeError(f"expected one gateway and one worker under omnirelay up, got {side.roles}")
        out_dir = opts.out_dir or data_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            warm = load_side(pool, side, opts.warmup, 8, opts.max_tokens)
            if warm.completed != warm.requests:
                raise RuntimeError(f"warm-up failed: {warm.error_sample}")
            results = [_level(opts, c, side, procs, pool, out_dir) for c in opts.concurrency]
        text = f"started {started}; ended {box_state()}\n\n{render(results)}"
        print(text, flush=True)
        if opts.out_dir:
            (out_dir / "profile.txt").write_text(text)
            log(f"raw py-spy files and profile.txt in {out_dir}")
        if opts.json_path:
            opts.json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))

    return run_with_stacks("omnirelay-profile-", work)
