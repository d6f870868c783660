"""``omnirelay bench token-cost``: what each streamed token costs omnirelay, as a ratio measured in
paired rounds (docs/performance.md, "Token cost").

Two sides, A and B, take turns in paired rounds (:mod:`benchmarks.paired`) at each concurrency.
Default: A is the reference (:mod:`benchmarks.sse_reference`, a bare uvicorn + Starlette server
streaming the same chunks: the floor any server pays per token) and B this tree's ``omnirelay up``
on the mock engine (``compose/pipelines/mock-text.yaml``: every per-token step of omnirelay runs, no
model computes); with ``tree_a``/``tree_b``, two such stacks from two checkouts. A side's load is
one client process, a closed loop of the official openai client
(:func:`benchmarks.frontend_capacity.client_job`).

A side's figures (:func:`figures`): the CPU µs per output token of each of its server processes
(the kernel's per-process clock; the gateway and the thinker worker of a stack, the reference's one
process), their sum, and the client's TPOT p50 (ms), each compared B ÷ A per round.
``--write-baseline`` records the ratios (``benchmarks/baselines/token_cost.json``); the CI guard
(tests/integration/test_token_cost_guard.py) holds the summed CPU to at most :data:`GUARD_FACTOR` ×
the baseline. The statistics, the baseline file and the comparison are pure functions.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.frontend_capacity import MOCK_PIPELINE, client_job, roles_cpu_s, stack_env, stack_roles
from benchmarks.harness import (
    ROOT,
    Processes,
    RequestTiming,
    commit,
    log,
    percentile,
    start_stack,
    wait_healthy,
)
from benchmarks.paired import Figure, Paired, Spread, render, run_paired, write_json
from libs.stack.local_nats import free_port

BASELINE_PATH = ROOT / "benchmarks" / "baselines" / "token_cost.json"
GUARD_FACTOR = 1.5
"""The guard fails when a measured ratio's median exceeds the baseline's × this (docs/testing.md
gives the spread it was chosen from)."""
GUARDED = ("cpu",)
"""The figures the guard holds: the summed server CPU per token (TPOT is reported, not guarded)."""
REFERENCE_MODEL = "reference"


# --- statistics (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One side's load at one concurrency in one round, as the client and the kernel's per-process
    CPU clock saw it."""

    requests: int
    """Requests sent."""
    completed: int
    """Requests that streamed content and ended without an error."""
    tokens: int
    """Output tokens of the completed requests (``usage.completion_tokens`` the client read)."""
    short: int
    """Completed requests whose token count was not ``max_tokens``."""
    chunks: int
    """Stream chunks with content the client counted in the completed requests (one per token
    from both servers)."""
    cpu_s: dict[str, float]
    """Role → CPU seconds (user + system) its processes used over the load."""
    tpot_p50_ms: float | None
    wall_s: float
    error_sample: str | None = None

    def cpu_us_per_token(self, role: str | None = None) -> float:
        """CPU µs per output token of ``role``, or of every role together (None)."""
        used = sum(self.cpu_s.values()) if role is None else self.cpu_s[role]
        return 1e6 * used / self.tokens if self.tokens else float("nan")


def sample_of(
    timings: Sequence[RequestTiming], cpu_s: dict[str, float], wall_s: float, max_tokens: int
) -> Sample:
    """A :class:`Sample` from the client's timings and the roles' CPU over the load."""
    good = [t for t in timings if t.ok]
    tpots = [t.tpot_s for t in good if t.tpot_s is not None]
    errors = [t.error for t in timings if not t.ok]
    return Sample(
        requests=len(timings),
        completed=len(good),
        tokens=sum(t.tokens for t in good),
        short=sum(t.tokens != max_tokens for t in good),
        chunks=sum(t.chunks for t in good),
        cpu_s=dict(cpu_s),
        tpot_p50_ms=percentile(tpots, 50) * 1e3 if tpots else None,
        wall_s=wall_s,
        error_sample=errors[0] if errors else None,
    )


def sanity_problems(sample: Sample, requests: int, max_tokens: int) -> list[str]:
    """Why ``sample`` does not measure what it claims: requests missing or failed, a token count
    other than ``requests × max_tokens`` (the usage the servers reported, and the content chunks the
    client counted itself), or no CPU read. Empty when sound."""
    out = []
    if sample.requests != requests or sample.completed != requests:
        out.append(
            f"{sample.completed} of {requests} requests completed (sent {sample.requests}; {sample.error_sample})"
        )
    if sample.tokens != requests * max_tokens or sample.short:
        out.append(
            f"{sample.tokens} tokens, expected {requests} × {max_tokens}; {sample.short} requests short"
        )
    if sample.chunks != requests * max_tokens:
        out.append(f"the client counted {sample.chunks} content chunks, expected {requests} × {max_tokens}")
    if sum(sample.cpu_s.values()) <= 0:
        out.append("no CPU time read for the servers")
    return out


def figures(roles: Sequence[str]) -> list[Figure[Sample]]:
    """What a sample gives, each compared B ÷ A per round: ``cpu`` (every role's CPU per token
    summed), ``cpu:<role>`` for each of B's ``roles`` (a side without that role: its sum), ``tpot``
    (the client's p50)."""

    def role_cpu(role: str) -> Callable[[Sample], float]:
        return lambda s: s.cpu_us_per_token(role if role in s.cpu_s else None)

    per_role = [Figure(f"cpu:{role}", "µs/token", role_cpu(role)) for role in roles]
    return [
        Figure("cpu", "µs/token", lambda s: s.cpu_us_per_token()),
        *per_role,
        Figure("tpot", "ms", lambda s: s.tpot_p50_ms or None),
    ]


def level(workload: str) -> int:
    """The concurrency of a workload named ``c=<n>``."""
    return int(workload.removeprefix("c="))


def summarize(paired: Paired[Sample], figs: Sequence[Figure[Sample]]) -> dict[int, dict[str, Spread]]:
    """Concurrency → figure → the spread of its per-round B ÷ A."""
    out: dict[int, dict[str, Spread]] = {}
    for w in paired.workloads:
        per = {f.name: paired.compared(f, "B", w) for f in figs}
        out[level(w)] = {name: s for name, s in per.items() if s is not None}
    return out


# --- the baseline (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """The committed ratio omnirelay ÷ reference at each concurrency, and how it was measured."""

    date: str
    commit: str
    rounds: int
    max_tokens: int
    requests: dict[int, int]
    """Concurrency → requests per side per round."""
    ratios: dict[int, dict[str, Spread]]
    note: str = ""


def baseline_json(b: Baseline) -> str:
    """The baseline file's text (JSON; concurrency keys as strings, ratios to 4 decimals)."""
    doc = asdict(b)
    doc["requests"] = {str(c): n for c, n in b.requests.items()}
    doc["ratios"] = {
        str(c): {
            k: {
                "median": round(s.median, 4),
                "low": round(s.low, 4),
                "high": round(s.high, 4),
                "n": s.n,
                "relative": round(s.relative, 4),
            }
            for k, s in figs.items()
        }
        for c, figs in b.ratios.items()
    }
    return json.dumps(doc, indent=2) + "\n"


def parse_baseline(text: str) -> Baseline:
    """A :class:`Baseline` from :func:`baseline_json`'s text (ValueError when a field is missing)."""
    try:
        doc = json.loads(text)
        return Baseline(
            date=doc["date"],
            commit=doc["commit"],
            rounds=int(doc["rounds"]),
            max_tokens=int(doc["max_tokens"]),
            requests={int(c): int(n) for c, n in doc["requests"].items()},
            ratios={
                int(c): {k: Spread(s["median"], s["low"], s["high"], int(s["n"])) for k, s in figs.items()}
                for c, figs in doc["ratios"].items()
            },
            note=doc.get("note", ""),
        )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a token-cost baseline: {e!r}") from None


def violations(
    measured: dict[int, dict[str, Spread]],
    baseline: Baseline,
    factor: float = GUARD_FACTOR,
    figures: Sequence[str] = GUARDED,
) -> list[str]:
    """Each guarded figure whose measured median exceeds the baseline's median × ``factor``, or that
    the baseline or the measurement lacks at a measured concurrency. Empty when within bounds."""
    out = []
    for c, figs in sorted(measured.items()):
        for name in figures:
            base = baseline.ratios.get(c, {}).get(name)
            got = figs.get(name)
            if base is None or got is None:
                out.append(f"c={c} {name}: {'no baseline' if base is None else 'not measured'}")
            elif got.median > base.median * factor:
                out.append(
                    f"c={c} {name}: ratio {got.median:.2f} (rounds {got.low:.2f}..{got.high:.2f}) > "
                    f"baseline {base.median:.2f} × {factor} = {base.median * factor:.2f}"
                )
    return out


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCostOptions:
    """What ``omnirelay bench token-cost`` runs (see the CLI for meanings)."""

    concurrency: tuple[int, ...] = (1, 16)
    rounds: int = 5
    requests: dict[int, int] = field(default_factory=lambda: {1: 48, 16: 128})
    """Concurrency → requests per side per round; a level not named gets 8 × c (at least 48)."""
    max_tokens: int = 64
    warmup: int = 32
    tree_a: Path | None = None
    tree_b: Path | None = None
    json_path: Path | None = None

    def requests_at(self, c: int) -> int:
        return self.requests.get(c, max(48, 8 * c))


@dataclass(frozen=True)
class Side:
    """One side of the pair: where to send requests and which processes' CPU is its cost."""

    name: str
    label: str
    base_url: str
    model: str
    roles: dict[str, list[int]]


def stack_side(procs: Processes, name: str, tree: Path | None, env: dict[str, str], data_dir: Path) -> Side:
    """``omnirelay up`` on the mock pipeline (of ``tree``, default this one); its cost roles are
    the gateway and the thinker worker."""
    from libs.common.pipeline import load_pipeline

    pipeline_path = (tree or ROOT) / "compose" / "pipelines" / "mock-text.yaml"
    pipeline_path = pipeline_path if pipeline_path.is_file() else MOCK_PIPELINE
    stack = start_stack(procs, f"stack {name}", pipeline_path, env, data_dir, tree=tree)
    found = stack_roles(stack, None, [])
    roles = {"gateway": found.get("gateway-1", []), "worker": found.get("worker", [])}
    if not all(roles.values()):
        raise RuntimeError(f"stack {name}: gateway or worker process not found among {sorted(found)}")
    label = f"omnirelay up, mock engine ({tree or ROOT})"
    return Side(name, label, stack.api_url, load_pipeline(pipeline_path).served_model_name, roles)


def _sides(opts: TokenCostOptions, procs: Processes, data_dir: Path) -> dict[str, Side]:
    env = stack_env(opts.concurrency)
    if opts.tree_a is not None and opts.tree_b is not None:
        return {
            n: stack_side(procs, n, t, env, data_dir) for n, t in (("A", opts.tree_a), ("B", opts.tree_b))
        }
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.sse_reference", "--port", str(port)]
    ref = procs.start("reference A", argv, {}, cwd=ROOT)
    stack = stack_side(procs, "B", None, env, data_dir)
    wait_healthy(ref, port, 60)
    label = "reference: bare uvicorn + Starlette SSE server (benchmarks/sse_reference.py)"
    return {
        "A": Side("A", label, f"http://127.0.0.1:{port}/v1", REFERENCE_MODEL, {"server": [ref.pid]}),
        "B": stack,
    }


def load_side(pool: ProcessPoolExecutor, side: Side, requests: int, c: int, max_tokens: int) -> Sample:
    """``requests`` streamed requests at concurrency ``c`` through ``side``, its roles' CPU around it."""
    before = roles_cpu_s(side.roles)
    t0 = time.monotonic()
    timings = pool.submit(client_job, [side.base_url], side.model, requests, c, max_tokens, 0).result()
    wall = time.monotonic() - t0
    after = roles_cpu_s(side.roles)
    return sample_of(timings, {r: after[r] - before[r] for r in after}, wall, max_tokens)


@dataclass(frozen=True)
class Measurement:
    """Every round of a run, what its sides were and the figures compared."""

    labels: dict[str, str]
    paired: Paired[Sample]
    figures: list[Figure[Sample]]

    def unsound(self, opts: TokenCostOptions) -> list[str]:
        """Every sample that does not measure what it claims (:func:`sanity_problems`)."""
        return [
            f"round {r.round} {r.workload} {r.arm}: {p}"
            for r in self.paired.runs
            for p in sanity_problems(r.result, opts.requests_at(level(r.workload)), opts.max_tokens)
        ]

    def render(self) -> str:
        """What A and B are, then the runner's table of the per-round B ÷ A."""
        return "\n".join(
            [f"A = {self.labels['A']}", f"B = {self.labels['B']}", render(self.paired, self.figures)]
        )


def _measure_sides(
    opts: TokenCostOptions, sides: dict[str, Side], pool: ProcessPoolExecutor
) -> Paired[Sample]:
    def warm_up(name: str) -> None:
        warm = load_side(pool, sides[name], opts.warmup, max(opts.concurrency), opts.max_tokens)
        if warm.completed != warm.requests:
            raise RuntimeError(f"warm-up of {sides[name].label} failed: {warm.error_sample}")

    def one(name: str, c: int, _: int) -> Sample:
        return load_side(pool, sides[name], opts.requests_at(c), c, opts.max_tokens)

    levels = {f"c={c}": c for c in opts.concurrency}
    cpu = figures(())[:1]
    return asyncio.run(run_paired(("A", "B"), levels, opts.rounds, one, warmup=warm_up, figures=cpu))


def measure(opts: TokenCostOptions) -> Measurement:
    """Start both sides, warm them, run the rounds; every process started is stopped at the end.
    Raises RuntimeError when a side fails to start or its warm-up fails (logs then kept, named)."""
    data_dir = Path(tempfile.mkdtemp(prefix="omnirelay-token-cost-"))
    procs = Processes(data_dir)
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            # No request: the client's process starts and imports its client while the sides start.
            client_ready = pool.submit(client_job, [], "", 0, 1, opts.max_tokens, 0)
            sides = _sides(opts, procs, data_dir)
            client_ready.result()
            paired = _measure_sides(opts, sides, pool)
    except RuntimeError as e:
        raise RuntimeError(f"{e} (logs kept in {data_dir})") from None
    finally:
        procs.stop_all()
    shutil.rmtree(data_dir, ignore_errors=True)
    return Measurement({n: s.label for n, s in sides.items()}, paired, figures(list(sides["B"].roles)))


def baseline_of(opts: TokenCostOptions, m: Measurement) -> Baseline:
    """The baseline a default-mode run measured (today's UTC date, this tree's commit)."""
    return Baseline(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        commit=commit(),
        rounds=opts.rounds,
        max_tokens=opts.max_tokens,
        requests={c: opts.requests_at(c) for c in opts.concurrency},
        ratios=summarize(m.paired, m.figures),
        note="omnirelay (gateway + thinker worker, mock engine) ÷ reference (benchmarks/sse_reference.py)",
    )


def run_token_cost_bench(
    opts: TokenCostOptions,
    write_baseline: Path | None = None,
    check: Path | None = None,
    factor: float = GUARD_FACTOR,
) -> int:
    """Measure, print the table; write the baseline or check against one. 0 on success, 1 when the
    run failed, a sample is not sound or the check found a ratio over its bound."""
    try:
        m = measure(opts)
    except RuntimeError as e:
        log(f"failed: {e}")
        return 1
    print(m.render(), flush=True)
    if opts.json_path:
        write_json(opts.json_path, opts, m.paired, m.figures)
    bad = m.unsound(opts)
    for line in bad:
        log(f"unsound sample: {line}")
    if bad:
        return 1
    if write_baseline:
        write_baseline.parent.mkdir(parents=True, exist_ok=True)
        write_baseline.write_text(baseline_json(baseline_of(opts, m)))
        log(f"baseline written to {write_baseline}")
    if check:
        over = violations(summarize(m.paired, m.figures), parse_baseline(check.read_text()), factor)
        for line in over:
            log(f"over the bound: {line}")
        return 1 if over else 0
    return 0
