"""The comparison of omnirelay's gateway with direct vLLM (``omnirelay bench gateway``, ``bench vllm``):
the statistics of one round of requests to one target and the figures the paired runner compares
(:data:`FIGURES`, :mod:`benchmarks.paired`), the verdict against the TTFT target, and what else ran
on the machine. Pure functions of client-side request timings (``time.perf_counter()`` seconds),
tested in ``tests/unit/test_bench_stats.py``; :func:`welch_t` is ``bench log-stats``' and
``bench sync``'s test of pooled means.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.harness import RequestTiming, Summary
from benchmarks.paired import Figure

GATEWAY, DIRECT = "omnirelay", "vllm"
TARGET_TITLES = {GATEWAY: "omnirelay", DIRECT: "vLLM direct"}
TTFT_TARGET_PCT = 20.0
"""The gateway's TTFT p50 at concurrency 1 may exceed direct vLLM's by at most this, percent."""


# --- statistics of the comparison (pure) ------------------------------------------------


@dataclass
class RoundResult:
    """One round: ``len(timings)`` requests to one target at one concurrency."""

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


def _latency_ms(attr: str, stat: str) -> Callable[[RoundResult], float | None]:
    def of(r: RoundResult) -> float | None:
        summary: Summary | None = getattr(aggregate([r]), attr)
        return None if summary is None else getattr(summary, stat) * 1e3

    return of


FIGURES: tuple[Figure[RoundResult], ...] = (
    *(
        Figure(f"{name} {stat}", "ms", _latency_ms(name.lower(), stat))
        for name in ("TTFT", "TPOT", "E2E")
        for stat in ("p50", "p90", "mean")
    ),
    Figure("throughput", "tok/s", lambda r: aggregate([r]).throughput_tok_s),
)
"""What a round of ``bench gateway`` gives: latencies in ms (p50, p90, mean), then output tokens
per second of the round."""
TTFT_P50 = FIGURES[0]


def verdict_line(
    ttft_ratio: float | None,
    concurrency: int = 1,
    target_pct: float = TTFT_TARGET_PCT,
    unreliable: str | None = None,
) -> str:
    """The sentence about the TTFT target from the gateway ÷ direct TTFT p50 ratio (None: not
    measured), e.g. ``gateway TTFT p50 at concurrency 1 is +12.0% over direct vLLM (target ≤
    +20%): met``; ``unreliable`` says why the comparison cannot be trusted."""
    if ttft_ratio is None:
        return f"gateway TTFT p50 at concurrency {concurrency}: not measured (target ≤ +{target_pct:.0f}%)"
    pct = (ttft_ratio - 1.0) * 100.0
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
        f"machine during the rounds: {span('foreign_omnirelay', '.0f')} other omnirelay processes, "
        f"{span('foreign_pytest', '.0f')} pytest, {span('foreign_vllm_engines', '.0f')} other vLLM "
        f"engines; other processes used {span('foreign_cpu_pct', '.0f')}% of a core; "
        f"load average {span('loadavg_1m', '.1f')}"
    )
    noisy = sum(m.get("foreign_cpu_pct", 0.0) > FOREIGN_CPU_NOISY_PCT for m in samples)
    if noisy:
        text += f" ({noisy} of {len(samples)} rounds shared the machine: expect noisy numbers)"
    return text


def welch_t(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(b) − mean(a) and its Welch–Satterthwaite degrees of freedom."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0, float(len(a) + len(b) - 2)
    t = (statistics.fmean(b) - statistics.fmean(a)) / se
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df


T_CRITICAL_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 8: 2.31, 10: 2.23, 15: 2.13, 20: 2.09}
"""Two-sided 5 % critical values of Student's t by degrees of freedom (1.96 from 30 on)."""


def t_critical_95(df: float) -> float:
    """The two-sided 5 % critical value of Student's t at ``df`` degrees of freedom (the table's
    row at or below it; the normal's from 30 on)."""
    if df >= 30:
        return 1.96
    return T_CRITICAL_95[max(k for k in T_CRITICAL_95 if k <= max(df, 1))]


def mean_delta_line(a: Sequence[float], b: Sequence[float]) -> str:
    """How the mean of ``b`` differs from ``a``'s, percent, with Welch's t and whether it is
    significant at α = 0.05 (pooled samples of two arms)."""
    t, df = welch_t(a, b)
    delta = (statistics.fmean(b) / statistics.fmean(a) - 1) * 100
    sig = "significant" if abs(t) > t_critical_95(df) else "not significant"
    return f"{delta:+.1f}% mean, Welch's t = {t:.2f} (df {df:.0f}), {sig} at alpha = 0.05"


def split_requests(total: int, rounds: int) -> list[int]:
    """Split ``total`` requests over ``rounds`` rounds as evenly as possible (larger ones first)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    base, extra = divmod(total, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


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
