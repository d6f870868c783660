"""The CI guard on omnirelay's per-token cost (issue 23 item 5; docs/performance.md, "Token cost").

A short run of ``omnirelay bench token-cost``'s default mode: this tree's ``omnirelay up`` on the
mock engine (a real nats-server, gateway, orchestrator and thinker worker) against the reference
server (a bare uvicorn + Starlette SSE server), alternated in paired rounds, streamed through the
official openai client. It fails when the median over rounds of (gateway + worker CPU per output
token) ÷ (the reference's) exceeds the committed baseline (benchmarks/baselines/token_cost.json) ×
``GUARD_FACTOR`` at c = 1 or c = 16: a ratio, so the machine's speed cancels out. First it checks
that each measurement measured what it claims: every request completed, and the client counted
exactly requests × max_tokens output tokens on both sides.
"""

from __future__ import annotations

import time

import pytest

from benchmarks.token_cost import (
    BASELINE_PATH,
    GUARD_FACTOR,
    TokenCostOptions,
    measure,
    parse_baseline,
    summarize,
    violations,
)

pytestmark = pytest.mark.integration

OPTIONS = TokenCostOptions(rounds=3)
"""The baseline's load (``bench token-cost``'s defaults) in 3 rounds instead of 5, so each round's
ratio is drawn from what the baseline's rounds were and one odd round cannot move the median.
About 45 s on the shared two-core box, the stack's start included (docs/testing.md)."""


def test_per_token_cost_within_the_baseline_bound():
    baseline = parse_baseline(BASELINE_PATH.read_text())
    assert (baseline.max_tokens, baseline.requests) == (OPTIONS.max_tokens, OPTIONS.requests), (
        "the baseline was measured with other requests"
    )
    t0 = time.monotonic()
    m = measure(OPTIONS)
    table = m.render()
    print(f"{table}\nmeasured in {time.monotonic() - t0:.1f} s")
    unsound = m.unsound(OPTIONS)
    assert not unsound, "\n".join(unsound)
    measured = summarize(m.paired, m.figures)
    assert set(measured) == set(OPTIONS.concurrency)
    assert {r.round for r in m.paired.runs} == set(range(OPTIONS.rounds))
    over = violations(measured, baseline, GUARD_FACTOR)
    assert not over, f"per-token cost over its bound ({baseline.commit}, {baseline.date}):\n" + "\n".join(
        [*over, table]
    )
