"""``bench vllm``'s CPU split (benchmarks/cpu_split.py and its tables in
benchmarks/vllm_client_paired.py): the arithmetic on hand-made snapshots, the process kinds on
real command lines, and a snapshot of a real child process against its own CPU clock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.comparison_stats import DIRECT, GATEWAY
from benchmarks.cpu_split import (
    CLIENT_KEY,
    ENGINE_KEY,
    FRONT_END_KEY,
    PROCESS_KEY_PREFIX,
    ProcessCpu,
    cpu_per_token,
    label_of,
    snapshot,
)
from benchmarks.paired import Paired, Run
from benchmarks.vllm_client_paired import ClientRun, by_process, front_side_loads


def test_cpu_per_token_splits_by_role_and_kind() -> None:
    before = {
        1: ProcessCpu("gateway", 10.0),
        2: ProcessCpu("VLLM::EngineCore", 5.0),
        3: ProcessCpu("nats-server", 1.0),
        4: ProcessCpu("worker", 2.0),  # ends during the run: not seen afterwards
    }
    after = {
        1: ProcessCpu("gateway", 10.5),
        2: ProcessCpu("VLLM::EngineCore", 7.0),
        3: ProcessCpu("nats-server", 1.25),
        5: ProcessCpu("worker", 0.25),  # born during the run: counts whole
    }
    out = cpu_per_token(before, after, client_s=0.5, tokens=1000)
    assert out[FRONT_END_KEY] == pytest.approx((0.5 + 0.25 + 0.25) * 1000)  # µs per token
    assert out[ENGINE_KEY] == pytest.approx(2.0 * 1000)
    assert out[CLIENT_KEY] == pytest.approx(0.5 * 1000)
    assert out[PROCESS_KEY_PREFIX + "gateway"] == pytest.approx(500)
    assert out[PROCESS_KEY_PREFIX + "worker"] == pytest.approx(250)
    assert out[PROCESS_KEY_PREFIX + "nats-server"] == pytest.approx(250)
    assert cpu_per_token(before, after, 0.5, 0) == {}


@pytest.mark.parametrize(
    ("comm", "argv", "label"),
    [
        ("python", ["/v/bin/python", "-m", "cli", "gateway", "--port", "1"], "gateway"),
        (
            "python",
            ["/v/bin/python3.12", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
            "api_server",
        ),
        ("nats-server", ["/v/bin/nats-server", "-js", "-m", "8222", "-p", "4222"], "nats-server"),
        ("VLLM::EngineCor", ["VLLM::EngineCore"], "VLLM::EngineCore"),
        ("python", ["/v/bin/python", "-c", "pass"], "python"),
        ("zombie", [], "zombie"),
    ],
)
def test_process_kinds(comm: str, argv: list[str], label: str) -> None:
    assert label_of(comm, argv) == label


def test_snapshot_reads_a_child_as_its_own_clock_does() -> None:
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint(time.process_time())\ninput()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        own = float(child.stdout.readline())  # type: ignore[union-attr]
        seen = snapshot([child.pid])[child.pid]
        assert not seen.engine and seen.label == "python"
        assert own <= seen.cpu_s < own + 0.05
    finally:
        child.kill()
        child.wait()


def _run(target: str, r: int, front: float, client: float, tput: float, **kinds: float) -> Run[ClientRun]:
    figures = {FRONT_END_KEY: front, CLIENT_KEY: client, "output_throughput": tput}
    figures |= {PROCESS_KEY_PREFIX + k: v for k, v in kinds.items()}
    return Run(target, "c=16", r, ClientRun(figures, 10, 0))


def test_front_side_load_and_the_table_by_process() -> None:
    paired: Paired[ClientRun] = Paired((GATEWAY, DIRECT), DIRECT, ("c=1", "c=16"))
    paired.runs += [
        _run(GATEWAY, 0, 150.0, 50.0, 4000.0, gateway=60.0, worker=50.0),
        _run(GATEWAY, 1, 170.0, 50.0, 4200.0, gateway=80.0, worker=40.0),
        _run(DIRECT, 0, 80.0, 60.0, 4100.0, api_server=80.0),
    ]
    assert front_side_loads(paired, GATEWAY, "c=16") == pytest.approx([0.8, 0.924])
    assert front_side_loads(paired, DIRECT, "c=16") == pytest.approx([0.574])
    assert front_side_loads(paired, GATEWAY, "c=1") == []
    header, rows = by_process(paired)
    assert header == ("process", "omnirelay c=1", "vLLM c=1", "omnirelay c=16", "vLLM c=16")
    assert rows == [
        ("api_server", "-", "-", "-", "80.0"),
        ("gateway", "-", "-", "70.0", "-"),
        ("worker", "-", "-", "45.0", "-"),
    ]
