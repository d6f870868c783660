"""The paired runner every A/B benchmark is a preset of (benchmarks/paired.py): the order of the
arms in each round, what a run is given and when, the per-round comparisons and their spread,
the table and the JSON. The arms here are fakes whose results are worked out by hand."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from benchmarks.paired import Figure, Paired, Run, order, render, run_paired, spread, write_json

VALUE = Figure("value", "ms", lambda x: x)
GAP = Figure("value", "ms", lambda x: x, compare="difference")
SEEN = Figure("seen", "", lambda x: x, compare="")


def test_the_order_alternates_and_reverses_more_arms() -> None:
    assert [order(("A", "B"), r) for r in range(3)] == [("A", "B"), ("B", "A"), ("A", "B")]
    assert order(("A", "B", "C", "D"), 1) == ("D", "C", "B", "A")


def test_every_workload_runs_on_every_arm_in_each_rounds_order_inside_its_active_block() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def active(arm: str):
        events.append(f"+{arm}")
        yield
        events.append(f"-{arm}")

    async def warmup(arm: str) -> None:
        events.append(f"warm {arm}")

    def measure(arm: str, n: int, r: int) -> float:  # a plain function
        events.append(f"{arm} {n} r{r}")
        return {"A": 10.0, "B": 12.0}[arm] * n + r

    paired = asyncio.run(
        run_paired(
            ("A", "B"), {"one": 1, "two": 2}, 2, measure, active=active, warmup=warmup, figures=[VALUE]
        )
    )
    assert events[:6] == ["+A", "warm A", "-A", "+B", "warm B", "-B"]
    runs = [e for e in events if e[0] not in "+-" and not e.startswith("warm")]
    assert runs == ["A 1 r0", "B 1 r0", "A 2 r0", "B 2 r0", "B 1 r1", "A 1 r1", "B 2 r1", "A 2 r1"]
    assert events[6:9] == ["+A", "A 1 r0", "-A"]
    assert paired.baseline == "A" and paired.others == ("B",) and paired.workloads == ("one", "two")
    assert paired.results("B", "two") == [24.0, 25.0]
    assert paired.per_round(VALUE, "B", "one") == pytest.approx([12 / 10, 13 / 11])


def test_a_coroutine_measure_is_awaited_and_the_baseline_may_be_another_arm() -> None:
    async def measure(arm: str, _: None, r: int) -> float:
        await asyncio.sleep(0)
        return {"with": 2.0, "without": 6.0}[arm]

    paired = asyncio.run(run_paired(("without", "with"), {"cell": None}, 3, measure, baseline="with"))
    assert paired.others == ("without",)
    s = paired.compared(VALUE, "without", "cell")
    assert s is not None and (s.median, s.n) == (3.0, 3)


def test_a_run_needs_two_arms_a_workload_and_a_round() -> None:
    with pytest.raises(ValueError):
        asyncio.run(run_paired(("A",), {"w": 1}, 1, lambda *_: 1.0))
    with pytest.raises(ValueError):
        asyncio.run(run_paired(("A", "B"), {"w": 1}, 0, lambda *_: 1.0))


def _paired(*runs: tuple[str, int, float | None]) -> Paired[float | None]:
    return Paired(("A", "B"), "A", ("w",), [Run(arm, "w", r, v) for arm, r, v in runs])


def test_comparisons_skip_rounds_without_both_values_and_a_zero_baseline() -> None:
    paired = _paired(
        ("A", 0, 2.0), ("B", 0, 3.0), ("A", 1, 0.0), ("B", 1, 5.0), ("B", 2, 1.0), ("A", 3, None)
    )
    assert paired.per_round(VALUE, "B", "w") == [1.5]  # round 1: baseline 0; 2, 3: one side only
    assert paired.per_round(GAP, "B", "w") == [1.0, 5.0]  # a difference of 0 is fine
    assert paired.per_round(SEEN, "B", "w") == []
    assert paired.median(VALUE, "B", "w") == 3.0 and paired.median(VALUE, "A", "w") == 1.0


def test_spread_keeps_the_values_in_round_order() -> None:
    s = spread([1.2, 3.0, 1.0, 1.1])
    assert s is not None
    assert (s.median, s.low, s.high, s.n, s.values) == (
        pytest.approx(1.15),
        1.0,
        3.0,
        4,
        (1.2, 3.0, 1.0, 1.1),
    )
    assert s.relative == pytest.approx(2.0 / 1.15)
    assert spread([]) is None


def test_the_table_shows_medians_the_median_comparison_its_range_and_each_round() -> None:
    paired = _paired(
        ("A", 0, 10.0), ("B", 0, 12.0), ("B", 1, 9.0), ("A", 1, 10.0), ("A", 2, 8.0), ("B", 2, 8.0)
    )
    lines = render(paired, [VALUE, GAP, SEEN]).splitlines()
    assert lines[0] == "3 paired rounds: A / B in even rounds, reversed in odd ones"
    assert lines[1].split() == ["figure", "B", "A", "B", "vs", "A", "min–max", "per", "round"]
    assert lines[3].split() == [
        "value",
        "(ms)",
        "9.00",
        "10.00",
        "1.00x",
        "0.90x–1.20x",
        "1.20x,",
        "0.90x,",
        "1.00x",
    ]
    assert lines[4].split() == [
        "value",
        "(ms)",
        "9.00",
        "10.00",
        "+0.00",
        "-1.00–+2.00",
        "+2.00,",
        "-1.00,",
        "+0.00",
    ]
    assert lines[5].split() == ["seen", "9.00", "10.00", "-", "-", "-"]
    assert "per round" not in render(paired, [VALUE], per_round=False)
    assert len({len(line) for line in lines[1:]}) == 1  # fixed width


def test_the_table_names_workloads_and_arms_when_there_are_several() -> None:
    paired: Paired[float] = Paired(("A", "B", "C"), "A", ("c=1", "c=16"))
    paired.runs += [
        Run(arm, w, 0, v) for arm, v in (("A", 1.0), ("B", 2.0), ("C", 4.0)) for w in ("c=1", "c=16")
    ]
    lines = render(paired, [VALUE]).splitlines()
    assert lines[1].split()[:7] == ["figure", "workload", "arm", "arm", "median", "A", "arm"]
    rows = [line.split() for line in lines[3:]]
    assert [(r[2], r[3], r[6]) for r in rows] == [
        ("c=1", "B", "2.00x"),
        ("c=1", "C", "4.00x"),
        ("c=16", "B", "2.00x"),
        ("c=16", "C", "4.00x"),
    ]


def test_the_json_holds_every_run_its_figures_and_every_comparison(tmp_path: Path) -> None:
    paired = _paired(("A", 0, 10.0), ("B", 0, 12.0), ("B", 1, 9.0), ("A", 1, 10.0))
    path = tmp_path / "out.json"
    write_json(path, {"rounds": 2, "tree": tmp_path}, paired, [VALUE, GAP])
    data = json.loads(path.read_text())
    assert data["options"] == {"rounds": 2, "tree": str(tmp_path)}
    assert (data["arms"], data["baseline"]) == (["A", "B"], "A")
    assert data["runs"][1] == {
        "arm": "B",
        "workload": "w",
        "round": 0,
        "figures": {"value": 12.0},
        "result": 12.0,
    }
    ratio, gap = data["compared"]
    assert (ratio["compare"], ratio["median"], ratio["values"]) == ("ratio", pytest.approx(1.05), [1.2, 0.9])
    assert (gap["compare"], gap["values"], gap["n"]) == ("difference", [2.0, -1.0], 2)
