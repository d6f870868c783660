"""The paired runner every A/B benchmark is a preset of: arms × workloads × rounds.

A machine's speed drifts far more than a change worth measuring, so the arms are measured one after
the other in rounds whose order alternates (A B, B A, ...; with more arms, reversed every other
round), every workload in every round. Two runs of one round share the machine's conditions, so an
arm is compared with the baseline arm round by round, arm ÷ baseline (or arm − baseline) of each
:class:`Figure`; the statistic is the median of those per-round values with their range
(:class:`Spread`).

A preset keeps what is its own: how its arms start, what makes an arm the one measured (``active``:
resume it while the others stay frozen, say), its warm-up, and what one run measures (``measure``,
whose result its figures read). Arms that are stacks run :func:`sequential` requests in
:func:`run_sequential`. Everything but the run loop and the stacks' helpers is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from benchmarks.harness import PROMPTS, RequestTiming, log, timed_request
from libs.stack.local_stack import Stack

T = TypeVar("T")
W = TypeVar("W")


@dataclass(frozen=True)
class Figure(Generic[T]):
    """A number read off one run's result (None: the run has none)."""

    name: str
    unit: str
    of: Callable[[T], float | None]
    compare: str = "ratio"
    """How an arm meets the baseline in each round: ``ratio`` (arm ÷ baseline), ``difference``
    (arm − baseline, in :attr:`unit`) or ``""`` (not compared: the arms' medians only)."""

    @property
    def title(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name


@dataclass(frozen=True)
class Run(Generic[T]):
    """One run: ``arm`` on the workload named ``workload`` in round ``round``."""

    arm: str
    workload: str
    round: int
    result: T


@dataclass(frozen=True)
class Spread:
    """The median of per-round values, their range and how many there were."""

    median: float
    low: float
    high: float
    n: int
    values: tuple[float, ...] = ()
    """The values themselves, in round order (empty when read back from a summary)."""

    @property
    def relative(self) -> float:
        """(high − low) ÷ median: the range as a share of the median."""
        return (self.high - self.low) / self.median if self.median else float("nan")


def spread(values: Sequence[float]) -> Spread | None:
    """Median, min and max of ``values`` (None when there are none)."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values), tuple(values))


def order(arms: Sequence[str], round_no: int) -> tuple[str, ...]:
    """The arms in the order round ``round_no`` measures them: as given in even rounds, reversed
    in odd ones (A B, B A, A B, ...)."""
    return tuple(arms) if round_no % 2 == 0 else tuple(reversed(arms))


@dataclass
class Paired(Generic[T]):
    """Every run of a paired measurement, and what its arms are compared with."""

    arms: tuple[str, ...]
    baseline: str
    workloads: tuple[str, ...]
    runs: list[Run[T]] = field(default_factory=list)

    @property
    def others(self) -> tuple[str, ...]:
        """The arms compared with the baseline."""
        return tuple(a for a in self.arms if a != self.baseline)

    def results(self, arm: str | None = None, workload: str | None = None) -> list[T]:
        """The results of ``arm`` on ``workload`` (None: every one), in run order."""
        return [
            r.result
            for r in self.runs
            if (arm is None or r.arm == arm) and (workload is None or r.workload == workload)
        ]

    def values(self, figure: Figure[T], arm: str, workload: str) -> dict[int, float]:
        """Round → ``figure`` of ``arm`` on ``workload`` (rounds without a value left out)."""
        got = {r.round: figure.of(r.result) for r in self.runs if r.arm == arm and r.workload == workload}
        return {rn: v for rn, v in got.items() if v is not None}

    def per_round(self, figure: Figure[T], arm: str, workload: str) -> list[float]:
        """``arm`` against the baseline in each round both have ``figure`` (a ratio's round with a
        baseline of 0 left out), in round order."""
        mine, base = self.values(figure, arm, workload), self.values(figure, self.baseline, workload)
        rounds = sorted(mine.keys() & base.keys())
        if figure.compare == "difference":
            return [mine[rn] - base[rn] for rn in rounds]
        if figure.compare == "ratio":
            return [mine[rn] / base[rn] for rn in rounds if base[rn] != 0]
        return []

    def compared(self, figure: Figure[T], arm: str, workload: str) -> Spread | None:
        """The spread of :meth:`per_round`."""
        return spread(self.per_round(figure, arm, workload))

    def median(self, figure: Figure[T], arm: str, workload: str) -> float | None:
        """``arm``'s median of ``figure`` over the rounds on ``workload``."""
        s = spread(list(self.values(figure, arm, workload).values()))
        return None if s is None else s.median


# --- arms that are stacks --------------------------------------------------------------------


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
async def resumed(stack: Stack) -> AsyncIterator[None]:
    """``stack`` (paused while another arm runs) resumed inside the block, paused after it."""
    stack.resume()
    try:
        yield
    finally:
        stack.pause()


async def sequential(
    stack: Stack, model: str, n: int, max_tokens: int, prompt: str, settle_first: int = 0
) -> list[RequestTiming]:
    """``n`` sequential streamed requests to ``stack``, after ``settle_first`` unmeasured ones in a
    row succeeded (a stack paused for long comes back with the next heartbeats); RuntimeError
    naming the first failure."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=stack.api_url, api_key="bench", timeout=120.0, max_retries=0) as client:
        if settle_first:
            await settle(stack.name, model, client, settle_first, max_tokens)
        timings = [await timed_request(client, model, prompt, max_tokens) for _ in range(n)]
    if failed := [t.error for t in timings if not t.ok]:
        raise RuntimeError(f"{stack.name}: {failed[0]}")
    return timings


# --- the run --------------------------------------------------------------------------------------


async def _maybe_await(value: Awaitable[T] | T) -> T:
    return await value if inspect.isawaitable(value) else value


async def run_paired(
    arms: Sequence[str],
    workloads: Mapping[str, W],
    rounds: int,
    measure: Callable[[str, W, int], Awaitable[T] | T],
    *,
    baseline: str | None = None,
    active: Callable[[str], AbstractAsyncContextManager[object]] | None = None,
    warmup: Callable[[str], Awaitable[object] | object] | None = None,
    figures: Sequence[Figure[T]] = (),
) -> Paired[T]:
    """Warm every arm up (``warmup(arm)``), then run ``rounds`` rounds: in each, every workload
    (name → what ``measure`` gets) on every arm in :func:`order`, each run inside
    ``active(arm)``; ``measure(arm, workload, round)`` (a coroutine function or not) returns the
    run's result. Each run is logged with its first figures. ``baseline`` defaults to the first arm."""
    if rounds < 1 or len(arms) < 2 or not workloads:
        raise ValueError("a paired run needs two arms, a workload and a round")
    out: Paired[T] = Paired(tuple(arms), baseline or arms[0], tuple(workloads))
    enter = active or (lambda arm: nullcontext())
    if warmup is not None:
        for arm in arms:
            async with enter(arm):
                await _maybe_await(warmup(arm))
    for r in range(rounds):
        for name, workload in workloads.items():
            for arm in order(arms, r):
                async with enter(arm):
                    result = await _maybe_await(measure(arm, workload, r))
                out.runs.append(Run(arm, name, r, result))
                shown = [(f, f.of(result)) for f in figures[:4]]
                text = ", ".join(f"{f.name} {_num(v)} {f.unit}".rstrip() for f, v in shown)
                log(f"round {r + 1}/{rounds} {name} {arm}: {text}")
    return out


def run_sequential(
    stacks: Mapping[str, Stack],
    workload: str,
    per_round: int,
    rounds: int,
    figures: Sequence[Figure[list[RequestTiming]]],
    model: str,
    max_tokens: int,
    prompt: str,
    warmup: int = 0,
    settle_first: int = 0,
) -> Paired[list[RequestTiming]]:
    """The paired rounds of the arms that are ``stacks``: every stack paused but the one a run
    resumes (:func:`resumed`), each run ``per_round`` :func:`sequential` requests (after
    ``settle_first``), after ``warmup`` unmeasured ones on each."""
    for stack in stacks.values():
        stack.pause()
    run = run_paired(
        list(stacks),
        {workload: per_round},
        rounds,
        lambda name, n, _: sequential(stacks[name], model, n, max_tokens, prompt, settle_first),
        active=lambda name: resumed(stacks[name]),
        warmup=lambda name: sequential(stacks[name], model, warmup, max_tokens, prompt),
        figures=figures,
    )
    return asyncio.run(run)


# --- the table and the JSON (pure) ---------------------------------------------------------------


def _num(v: float | None) -> str:
    """``v`` to about three significant digits (``-`` for none)."""
    if v is None or v == 0:
        return "-" if v is None else "0"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def _versus(v: float, compare: str) -> str:
    return f"{v:.2f}x" if compare == "ratio" else f"{v:+.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A fixed-width text table under a rule: the first ``left`` columns flush left, the others
    flush right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def render(paired: Paired[T], figures: Sequence[Figure[T]], per_round: bool = True) -> str:
    """The table: per figure, workload and arm (besides the baseline), both arms' medians over the
    rounds, then the median of the per-round comparisons (``1.08x``: arm ÷ baseline; ``+0.50``:
    arm − baseline, in the figure's unit) with their min–max and, with ``per_round``, each
    round's."""
    several = len(paired.workloads) > 1, len(paired.others) > 1
    arm = "arm" if several[1] else paired.others[0]
    header = ["figure", *(["workload"] * several[0]), *(["arm"] * several[1])]
    header += ["arm median" if several[1] else arm, paired.baseline, f"{arm} vs {paired.baseline}", "min–max"]
    header += ["per round"] * per_round
    rows = []
    for f in figures:
        for w in paired.workloads:
            for arm in paired.others:
                cells = [f.title, *([w] * several[0]), *([arm] * several[1])]
                cells += [_num(paired.median(f, arm, w)), _num(paired.median(f, paired.baseline, w))]
                s = paired.compared(f, arm, w)
                if s is None:
                    cells += ["-", "-"] + ["-"] * per_round
                else:
                    cells += [
                        _versus(s.median, f.compare),
                        f"{_versus(s.low, f.compare)}–{_versus(s.high, f.compare)}",
                    ]
                    cells += [", ".join(_versus(v, f.compare) for v in s.values)] * per_round
                rows.append(cells)
    rounds = len({r.round for r in paired.runs})
    title = f"{rounds} paired rounds: {' / '.join(paired.arms)} in even rounds, reversed in odd ones"
    return title + "\n" + table(header, rows, left=1 + sum(several))


def _plain(value: object) -> object:
    """What JSON cannot hold as it is: a dataclass as its fields, anything else (a path) as its text."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def write_json(path: Path, options: object, paired: Paired[T], figures: Sequence[Figure[T]]) -> None:
    """The raw numbers: ``options``, every run with its figures and its whole result, and every
    comparison with its per-round values."""
    data = {
        "options": options,
        "arms": list(paired.arms),
        "baseline": paired.baseline,
        "runs": [
            {
                "arm": r.arm,
                "workload": r.workload,
                "round": r.round,
                "figures": {f.name: f.of(r.result) for f in figures},
                "result": r.result,
            }
            for r in paired.runs
        ],
        "compared": [
            {"figure": f.name, "unit": f.unit, "compare": f.compare, "workload": w, "arm": arm}
            | dataclasses.asdict(s)
            for f in figures
            for w in paired.workloads
            for arm in paired.others
            if (s := paired.compared(f, arm, w)) is not None
        ],
    }
    path.write_text(json.dumps(data, indent=2, default=_plain))
    log(f"raw numbers written to {path}")
