"""The comparison of omnirelay's gateway with direct vLLM (``omnirelay bench gateway``, ``bench vllm``):
the statistics of one round of requests to one target and the figures the paired runner compares
(:data:`FIGURES`, :mod:`benchmarks.paired`), the verdict against the TTFT target, and what else ran
on the machine. Pure functions of client-side request timings (``time.perf_counter()`` seconds),
tested in ``tests/unit/test_bench_stats.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.harness import RequestTiming, percentile
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


def _latency_ms(attr: str, stat: str) -> Callable[[RoundResult], float | None]:
    """``stat`` (``p50``, ``p90`` or ``mean``) of ``attr`` of the round's successful requests, in ms."""

    def of(r: RoundResult) -> float | None:
        xs = [v for t in r.timings if (v := getattr(t, attr)) is not None]
        if not xs:
            return None
        return 1e3 * (statistics.fmean(xs) if stat == "mean" else percentile(xs, float(stat[1:])))

    return of


def _throughput(r: RoundResult) -> float:
    """Output tokens of the round's successful requests ÷ its wall time, tokens per second."""
    return sum(t.tokens for t in r.timings if t.ok) / r.wall_s if r.wall_s > 0 else 0.0


FIGURES: tuple[Figure[RoundResult], ...] = (
    *(
        Figure(f"{name} {stat}", "ms", _latency_ms(f"{name.lower()}_s", stat))
        for name in ("TTFT", "TPOT", "E2E")
        for stat in ("p50", "p90", "mean")
    ),
    Figure("throughput", "tok/s", _throughput),
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


def split_requests(total: int, rounds: int) -> list[int]:
    """Split ``total`` requests over ``rounds`` rounds as evenly as possible (larger ones first)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    base, extra = divmod(total, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def parse_concurrency(text: str) -> list[int]:
    """``"1,16"`` → ``[1, 16]`` (each ≥ 1, duplicates dropped, order kept)."""
    out = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    if not out:
        raise ValueError("no concurrency level given")
    if min(out) < 1:
        raise ValueError(f"concurrency must be at least 1, got {min(out)}")
    return out


def default_requests(concurrency: int) -> int:
    """Requests per (target, concurrency) when ``--requests`` is not given: at c=1 enough that the
    TTFT median is not at the mercy of a few scheduling hiccups; otherwise a full batch in each of
    the default 8 rounds."""
    return 240 if concurrency == 1 else max(128, 8 * concurrency)
