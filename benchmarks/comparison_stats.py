"""The comparison of two targets measured in paired rounds (``omnirelay bench gateway``, ``bench vllm``):
which target a round measures first, the statistics of each (target, concurrency) cell, the
gateway ÷ direct table, the verdict against the TTFT target, and what else ran on the machine.
Pure functions of client-side request timings (``time.perf_counter()`` seconds), tested in
``tests/unit/test_bench_stats.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.harness import RequestTiming, Summary

GATEWAY, DIRECT = "omnirelay", "vllm"
TARGET_TITLES = {GATEWAY: "omnirelay", DIRECT: "vLLM direct"}
TTFT_TARGET_PCT = 20.0
"""The gateway's TTFT p50 at concurrency 1 may exceed direct vLLM's by at most this, percent."""


# --- statistics of the comparison (pure) ------------------------------------------------


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
