"""``omnirelay inspect`` beside ``omnirelay up``: it finds the stack through the ``stack.json`` the
launcher writes (no flag), ignores a file whose launcher is gone, and ends within seconds with a
message naming the URL and its source when nothing answers there. A real nats-server, no vLLM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
import yaml
from typer.testing import CliRunner

from cli.launcher import announce
from cli.main import app
from cli.stack_file import (
    DEFAULT_NATS_URL,
    PROBE_TIMEOUT_S,
    StackInfo,
    read_live_stack,
    remove_stack_file,
    resolve_nats_url,
    stack_file,
    write_stack_file,
)
from libs.common.bus import ensure_topology
from libs.common.subjects import Subjects
from libs.stack.local_nats import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PIPELINE = "inspectprobe"
STARTUP_MARGIN_S = 10.0
"""What a Python process needs to import the CLI on a loaded 2-core box, on top of the bound the
command itself keeps, seconds."""


def _cli(*args: str, cwd: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m cli <args>`` in ``cwd`` with no NATS variable in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "OMNIRELAY_NATS_URL")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=cwd,
        env={**env, **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def pipeline_file(tmp_path: Path) -> Path:
    """The text-only pipeline renamed, so its streams are this test's own."""
    spec = yaml.safe_load((REPO / "compose/pipelines/text-only.yaml").read_text())
    spec["name"] = PIPELINE
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
async def declared(nats_server):
    """The pipeline's streams and buckets on the tests' server, deleted afterwards."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subjects = Subjects(PIPELINE)
    await ensure_topology(js, subjects)
    yield
    for name in (subjects.requests_stream, subjects.stages_stream, subjects.events_stream):
        await js.delete_stream(name)
    await nc.close()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_launchers_file_says_where_the_stack_is_and_goes_on_a_clean_stop(tmp_path, pipeline_file) -> None:
    data_dir = tmp_path / "data"
    path = announce(data_dir, 8123, "nats://127.0.0.1:4999", "http://127.0.0.1:8999", PIPELINE, pipeline_file)
    assert path == data_dir / "stack.json"
    written = json.loads(path.read_text())
    assert written["pid"] == os.getpid()
    assert written["nats_url"] == "nats://127.0.0.1:4999"
    assert written["nats_monitor_urls"] == ["http://127.0.0.1:8999"]
    assert written["gateway_url"] == "http://127.0.0.1:8123"
    assert written["pipeline_file"] == str(pipeline_file)
    assert [p.name for p in data_dir.iterdir()] == ["stack.json"]  # no temporary file left
    assert read_live_stack(data_dir) == StackInfo(**written)

    remove_stack_file(data_dir, os.getpid() + 1)  # another launcher's stop leaves it alone
    assert path.exists()
    remove_stack_file(data_dir, os.getpid())
    assert not path.exists()


def test_a_file_whose_launcher_is_gone_is_ignored(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("OMNIRELAY_NATS_URL", raising=False)
    live = announce(tmp_path, 8000, "nats://127.0.0.1:4999", None, PIPELINE, tmp_path / "p.yaml")
    info = StackInfo(**json.loads(live.read_text()))
    assert resolve_nats_url(None, tmp_path).url == "nats://127.0.0.1:4999"

    for stale in (
        StackInfo(**{**info.__dict__, "pid": _dead_pid()}),
        StackInfo(**{**info.__dict__, "pid_created": info.pid_created - 3600}),  # the pid reused
    ):
        write_stack_file(tmp_path, stale)
        assert read_live_stack(tmp_path) is None
        target = resolve_nats_url(None, tmp_path)
        assert target.url == DEFAULT_NATS_URL
        assert "the default" in target.source

    stack_file(tmp_path).write_text("{not json")
    assert resolve_nats_url(None, tmp_path).url == DEFAULT_NATS_URL


def test_a_flag_or_variable_wins_over_the_file(tmp_path, monkeypatch) -> None:
    announce(tmp_path, 8000, "nats://127.0.0.1:4999", None, PIPELINE, tmp_path / "p.yaml")
    monkeypatch.setenv("NATS_URL", "nats://10.0.0.1:4222")
    assert (resolve_nats_url(None, tmp_path).url, resolve_nats_url(None, tmp_path).source) == (
        "nats://10.0.0.1:4222",
        "NATS_URL",
    )
    target = resolve_nats_url("nats://10.0.0.2:4222", tmp_path)
    assert (target.url, target.source) == ("nats://10.0.0.2:4222", "--nats-url")


def test_inspect_with_no_flag_reads_the_file_and_reaches_that_server(
    tmp_path, nats_server, pipeline_file, declared
) -> None:
    announce(tmp_path / ".omnirelay", 8000, nats_server.url, None, PIPELINE, pipeline_file)
    r = _cli("inspect", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["pipeline"] == PIPELINE  # the pipeline came from the file too
    subjects = Subjects(PIPELINE)
    assert [s["stream"] for s in snap["streams"]] == [
        subjects.requests_stream,
        subjects.stages_stream,
        subjects.events_stream,
    ]
    assert all("missing" not in s and s["messages"] == 0 for s in snap["streams"])  # declared above


def _unreachable(r: subprocess.CompletedProcess[str], url: str, source: str) -> None:
    assert r.returncode != 0
    assert f"cannot reach NATS at {url}" in r.stderr
    assert f"the URL came from {source}" in r.stderr
    assert "--nats-url / NATS_URL" in r.stderr


def test_inspect_of_a_closed_port_says_so_and_exits(tmp_path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = _cli("inspect", "--nats-url", url, cwd=tmp_path)
    assert time.monotonic() - t0 < PROBE_TIMEOUT_S + STARTUP_MARGIN_S
    _unreachable(r, url, "--nats-url")
    assert "Connect call failed" in r.stderr


def test_inspect_of_a_port_that_never_answers_gives_up_within_its_bound(tmp_path) -> None:
    with socket.socket() as mute:  # connections complete in the backlog; no INFO ever comes
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"nats://127.0.0.1:{mute.getsockname()[1]}"
        t0 = time.monotonic()
        r = _cli("inspect", cwd=tmp_path, env_extra={"NATS_URL": url})
        elapsed = time.monotonic() - t0
    assert PROBE_TIMEOUT_S / 2 <= elapsed < PROBE_TIMEOUT_S + STARTUP_MARGIN_S  # it did wait, then stopped
    _unreachable(r, url, "NATS_URL")


def test_a_service_that_found_a_dead_url_by_itself_exits_saying_so(tmp_path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    announce(tmp_path / ".omnirelay", 8000, url, None, PIPELINE, tmp_path / "p.yaml")
    t0 = time.monotonic()
    r = _cli("orchestrator", cwd=tmp_path)
    assert time.monotonic() - t0 < PROBE_TIMEOUT_S + STARTUP_MARGIN_S
    assert r.returncode == 1
    _unreachable(r, url, str(Path(".omnirelay") / "stack.json"))


def test_up_given_a_nats_that_does_not_answer_says_so_before_starting_anything(tmp_path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["up", "--nats-url", url, "--data-dir", str(tmp_path)])
    assert time.monotonic() - t0 < PROBE_TIMEOUT_S + 1
    assert result.exit_code == 1
    assert f"cannot reach NATS at {url}" in result.output
    assert "`up` starts its own" in result.output
    assert list(tmp_path.iterdir()) == []  # no store, no stack.json: nothing was started
