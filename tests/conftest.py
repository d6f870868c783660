"""Shared fixtures: a real nats-server with JetStream on free ports in a temp dir."""

from __future__ import annotations

import os
import socket
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common import tracing
from libs.common.runtime import freeze_startup_heap
from libs.stack.local_nats import free_port, nats_server_argv, raise_broker_share
from libs.stack.processes import wait_for
from tests import needs
from tests.broker_watch import BrokerWatch
from tests.procs import STARTED, close_session_forker, session_forker, stop_left

E2E_DIR = Path(__file__).parent / "e2e"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``make test``, start before collection what the tests wait for longest: the session's
    forker, and the e2e stack (with the session's nats-server) when the e2e tests are selected.
    Their imports (torch and vLLM, ~12 s of a core each) and the stack's engines then start while
    pytest collects (~20 s) instead of before the first test that needs them. A run by hand starts
    each on first use."""
    if os.environ.get(needs.NEED_ALL_ENV) != "1":
        return
    session_forker()
    if _selects(session.config, E2E_DIR):
        from tests.e2e.launched import launched

        # The session's temporary directories, as the ``tmp_path_factory`` fixture returns them.
        tmp = session.config._tmp_path_factory  # type: ignore[attr-defined]
        launched(session_nats(tmp).url, tmp)


def _selects(config: pytest.Config, directory: Path) -> bool:
    """Whether the session's arguments take in the tests of ``directory``: it, a directory above
    it or a path in it."""
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == directory or path in directory.parents or directory in path.parents:
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report: pytest.CollectReport) -> None:
    """With ``OMNIRELAY_TESTS_NEED_ALL=1`` (``make test``), a test module skipped at collection (a
    module-level ``pytest.importorskip`` of a dependency that is missing) is an error, not a skip."""
    if report.skipped and os.environ.get(needs.NEED_ALL_ENV) == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped at collection while {needs.NEED_ALL_ENV}=1: {report.longrepr}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap that collection built (torch, vllm, transformers: ~640 k objects).

    Tests time requests on the client's clock and compare with the services' metrics; a full
    collection over that heap stalls the test process for ~0.4 s on these machines and shows up
    as latency no service had. The services do the same after start-up.
    """
    freeze_startup_heap()


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    def open_() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(open_, f"port {port} open", timeout_s)


SESSION_MAX_FILE_STORE = "1T"
"""JetStream's file-store bound for the session server. Every pipeline a test module declares
reserves its stages stream's ``max_bytes`` (1 GiB) on it, and about fifty modules share it; the
default bound, 75 % of the disk free at start, would refuse streams once the disk is fuller."""


class NatsServer:
    """A nats-server process started for the tests."""

    def __init__(self, store: Path) -> None:
        self.port, self.monitor_port, self.profile_port = free_port(), free_port(), free_port()
        self.store = store
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        conf = self.store / "session.conf"
        conf.write_text(f"jetstream {{\n  max_file_store: {SESSION_MAX_FILE_STORE}\n}}\n")
        argv = nats_server_argv(self.store, self.port, self.monitor_port)
        argv += ["-c", str(conf), "--profile", str(self.profile_port)]  # profile: goroutine dumps
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        raise_broker_share(self.proc.pid)  # a session of its own, weighted above the services'
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


_SESSION_NATS: list[NatsServer] = []


def session_nats(tmp_path_factory: pytest.TempPathFactory) -> NatsServer:
    """The session's nats-server, started on the first call."""
    if not _SESSION_NATS:
        server = NatsServer(tmp_path_factory.mktemp("jetstream"))
        server.start()
        _SESSION_NATS.append(server)
    return _SESSION_NATS[0]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = session_nats(tmp_path_factory)
    assert server.proc is not None
    watch = BrokerWatch(
        server.proc.pid,
        server.monitor_port,
        server.profile_port,
        tmp_path_factory.getbasetemp() / "broker-watch",
    )
    watch.start()
    _BROKER_WATCHES.append(watch)
    yield server
    watch.stop()
    server.stop()


_BROKER_WATCHES: list[BrokerWatch] = []
"""The session's broker watches (one per session server), for the summary line."""


_MODULE_SECONDS: Counter[str] = Counter()
"""Test module → seconds its tests' setup, call and teardown took (pytest's own durations)."""
MODULES_SHOWN = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per broker watch: the silences of the session's nats-server (tests/broker_watch.py);
    then the modules that took longest (the suite's time budget, docs/testing.md)."""
    for watch in _BROKER_WATCHES:
        terminalreporter.write_line(watch.summary())
    if not _MODULE_SECONDS:
        return
    by_dir = Counter({d: 0.0 for d in ("tests/unit", "tests/integration", "tests/e2e")})
    for module, seconds in _MODULE_SECONDS.items():
        by_dir["/".join(module.split("/")[:2])] += seconds
    terminalreporter.write_sep("=", f"slowest {MODULES_SHOWN} test modules (setup + call + teardown)")
    for module, seconds in _MODULE_SECONDS.most_common(MODULES_SHOWN):
        terminalreporter.write_line(f"{seconds:8.1f}s {module}")
    terminalreporter.write_line(
        "by directory: " + ", ".join(f"{d} {s / 60:.1f} min" for d, s in sorted(by_dir.items()) if s)
    )


@pytest.fixture(scope="module", autouse=True)
def _no_service_outlives_its_module() -> Iterator[None]:
    """Stop every service process started during the module and still running at its end, but a
    session-wide fixture's (``ServiceProcess.shared``). A module fixture whose setup fails after
    starting some never reaches its own teardown: in a CI run of 2026-11-29 an orchestrator, a
    gateway and three workers ran on through the rest of the session, and after it."""
    first = len(STARTED)
    yield
    stop_left([p for p in STARTED[first:] if not p.shared])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Nothing the tests started runs on after them (the session's nats-server included: started
    before collection, it outlives a session that ran no test)."""
    stop_left(STARTED)
    close_session_forker()
    while _SESSION_NATS:
        _SESSION_NATS.pop().stop()


@pytest.fixture(autouse=True)
def _tracing_left_as_found() -> Iterator[None]:
    """No test may leave in-process tracing switched on for the tests after it
    (use ``tests.otlp_receiver.tracing_in_this_process``)."""
    before = tracing._enabled
    yield
    assert tracing._enabled == before, "this test left in-process tracing switched on"
