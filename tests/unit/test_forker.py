"""Services forked from a stack's forker (``libs/stack/forker.py``) behave as the ``python -m``
they stand for: their own output, environment, exit status and session; restarted by a policy;
and a forker that dies leaves no process of the stack waited for forever. A service titles itself
with its name, forked or not (``libs/common/logs.py``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from libs.stack.forker import LOST_EXIT, Forker
from libs.stack.processes import LAUNCHER_RESTARTS, Process, until, wait_for
from tests.procs import gone


@pytest.fixture
def forker(tmp_path: Path):
    f = Forker(preload=("json",))
    yield f
    f.close()


def _module(tmp_path: Path, body: str) -> tuple[list[str], dict[str, str]]:
    """``python -m forked_probe`` with ``body`` as the module, and an environment that finds it."""
    (tmp_path / "forked_probe.py").write_text(body)
    return [sys.executable, "-m", "forked_probe"], {"PYTHONPATH": str(tmp_path)}


def test_a_forked_module_has_its_arguments_environment_output_and_exit_code(tmp_path, forker) -> None:
    body = (
        "import os, sys\n"
        "print('args', sys.argv[1:], os.environ.get('PROBE'), os.getsid(0) == os.getpid())\n"
        "sys.exit(3)\n"
    )
    argv, env = _module(tmp_path, body)
    p = Process("probe", [*argv, "a", "b"], {**env, "PROBE": "yes"}, tmp_path / "probe.log", forker=forker)
    p.start()
    assert p.proc.wait(10) == 3
    assert p.text() == "args ['a', 'b'] yes True\n"


def test_a_forked_service_is_titled_stopped_by_its_signal_and_reported(tmp_path, forker) -> None:
    argv, env = _module(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    p = Process("sleeper-1", argv, env, tmp_path / "s.log", forker=forker).start()
    wait_for(lambda: "up" in p.text(), "the service up", 10)
    title = Path(f"/proc/{p.pid}/cmdline").read_text().rstrip("\0")
    assert title == f"{sys.executable} -m forked_probe [sleeper-1]"
    assert p.stop(5) == -signal.SIGTERM and gone(p.pid)


@pytest.mark.parametrize("forked", [True, False])
def test_a_service_is_titled_with_its_name_once_forked_or_not(tmp_path, forker, forked) -> None:
    body = (
        "import time\nfrom libs.common.logs import set_service_identity\n"
        "set_service_identity('INFO', 'thinker-0')\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    argv, env = _module(tmp_path, body)
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parents[2])
    p = Process("thinker-0", argv, env, tmp_path / "t.log", forker=forker if forked else None).start()
    try:
        wait_for(lambda: "up" in p.text(), "the service up", 30)
        title = Path(f"/proc/{p.pid}/cmdline").read_text().rstrip("\0")
        assert title == f"{sys.executable} -m forked_probe [thinker-0]"
    finally:
        p.stop(5)


async def test_a_supervised_forked_service_that_dies_is_forked_again(tmp_path, forker) -> None:
    argv, env = _module(tmp_path, "import time\ntime.sleep(60)\n")
    notes: list[str] = []
    p = Process("victim", argv, env, tmp_path / "v.log", forker=forker).start()
    p.supervise(LAUNCHER_RESTARTS, notes.append)
    try:
        first = p.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: gone(first), "the killed service gone")
        await until(lambda: p.restarts == 1, "forked again", timeout_s=10)
        assert p.pid != first and p.returncode is None
        await until(
            lambda: Path(f"/proc/{p.pid}/cmdline").read_text().rstrip("\0").endswith("[victim]"),
            "the new incarnation titled",  # it titles itself just after the fork
        )
    finally:
        p.stop(5)
    assert notes[0].startswith(f"victim (pid {first}) ended with signal 9 (SIGKILL)")


async def test_a_service_whose_forker_died_counts_as_ended_once_it_is_gone(tmp_path, forker) -> None:
    argv, env = _module(tmp_path, "import time\ntime.sleep(60)\n")
    p = Process("orphan", argv, env, tmp_path / "o.log", forker=forker).start()
    forker.proc.kill()
    await until(lambda: not forker.alive, "the stack saw its forker gone")
    assert p.returncode is None  # it runs on
    os.kill(p.pid, signal.SIGKILL)
    await until(lambda: p.returncode is not None, "the orphan counted as ended")
    assert p.returncode == LOST_EXIT
    # a start after the forker's death is a process of its own
    q = Process("after", argv, env, tmp_path / "a.log", forker=forker).start()
    try:
        await until(
            lambda: Path(f"/proc/{q.pid}/cmdline").read_text().split("\0")[1:3] == ["-m", "forked_probe"],
            "the start after the forker's death executed python itself",
        )
    finally:
        q.stop(5)
