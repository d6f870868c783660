"""Starting omnirelay services as real processes for tests, with their output in a log file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from benchmarks.process_table import descendants
from libs.common.pipeline import load_pipeline
from libs.stack.forker import Forker, forking_wanted
from libs.stack.local_nats import free_port
from libs.stack.process_plan import SERVICE_IMPORTS
from libs.stack.processes import Process, until, wait_for

_forker: list[Forker] = []
"""The session's forker of services, once one was started (:func:`session_forker`)."""


def session_forker() -> Forker | None:
    """The forker the tests' services are forked from (:mod:`libs.stack.forker`), as a stack's
    are: started on first use, its output in a file beside the session's temporary files; None
    with ``OMNIRELAY_FORKER=off``."""
    if not forking_wanted():
        return None
    if not _forker:
        with _forker_log().open("ab") as out:
            _forker.append(Forker(SERVICE_IMPORTS, out.fileno()))
    return _forker[0]


def close_session_forker() -> None:
    """End the session's forker (after its services)."""
    while _forker:
        _forker.pop().close()
        _forker_log().unlink(missing_ok=True)


def _forker_log() -> Path:
    return Path(tempfile.gettempdir()) / f"omnirelay-tests-forker-{os.getpid()}.log"


class ServiceProcess(Process):
    """``python -m cli <args>`` with extra environment, logging to ``log``, forked from the
    session's forker (``forked``) or started as a new Python."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, *, forked: bool = True) -> None:
        forker = session_forker() if forked else None
        super().__init__(args[0], [sys.executable, "-m", "cli", *args], env, log, forker=forker)
        self.args, self.log = args, log
        self.metrics_url: str | None = None
        self.shared = False
        """Belongs to a session-wide fixture: outlives the module that started it."""

    @property
    def admin_url(self) -> str:
        """The base URL of :attr:`metrics_url` (a gateway's admin port: ``/metrics``,
        ``/prometheus/targets``)."""
        assert self.metrics_url is not None, "started without a metrics port (start_service sets one)"
        return self.metrics_url.removesuffix("/metrics")

    @property
    def port(self) -> int:
        """The port of :attr:`metrics_url`: the one a registry record of this service names (a
        worker's or orchestrator's metrics port, a gateway's admin port)."""
        assert self.metrics_url is not None, "started without a metrics port (start_service sets one)"
        port = urlparse(self.metrics_url).port
        assert port is not None, self.metrics_url
        return port

    def start(self) -> ServiceProcess:
        """Start the process (again, for a service a test stopped: same command, environment and
        ports, its output appended to the same log)."""
        super().start()
        STARTED.append(self)
        return self

    def wait_log(self, *needles: str, timeout_s: float = 60.0) -> str:
        """The first line of this incarnation's output containing all ``needles`` (waits for it;
        fails if the process exits first)."""

        def line() -> str | None:
            return next((ln for ln in self.text().splitlines() if all(n in ln for n in needles)), None)

        try:
            return wait_for(line, f"{self.args}: a log line with {needles!r}", timeout_s, 0.1, watch=[self])
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{self.text()[-3000:]}") from None

    async def await_log(self, *needles: str, timeout_s: float = 60.0) -> str:
        """:meth:`wait_log` for async tests (does not block their event loop)."""
        return await asyncio.to_thread(self.wait_log, *needles, timeout_s=timeout_s)


def stop_process(proc: subprocess.Popen[bytes], sig: int, timeout_s: float) -> int:
    """Send ``sig`` to a process started in its own session and wait up to ``timeout_s``; then
    SIGKILL its whole process group. Its exit code."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


STARTED: list[ServiceProcess] = []
"""Every service process the tests started, in order (``tests/conftest.py`` stops what a module,
or the session, left running)."""


def stop_left(procs: Iterable[ServiceProcess]) -> None:
    """Stop every one of ``procs`` still running (continued first: a fault test may have left it
    stopped)."""
    stop_all([p for p in procs if p.returncode is None])


def stop_all(procs: Iterable[Process]) -> None:
    """Stop every process at once (SIGCONT, SIGTERM, SIGKILL of its group after its stop timeout):
    a vLLM worker takes seconds to shut its engine down, and a stack's workers do it side by side
    rather than in turn."""
    started = [p for p in procs if p.proc is not None]
    if started:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(Process.stop, started))


def start_service(
    args: list[str], nats_url: str, pipeline: Path, log: Path, env: dict[str, str] | None = None
) -> ServiceProcess:
    """A service of ``pipeline`` with --log-stats on and its ``/metrics`` on a free port
    (``metrics_url``): the orchestrator's and a worker's metrics port, the gateway's admin port
    (``/metrics`` and ``/prometheus/targets`` below it: ``metrics_url`` is the one way a test
    finds a gateway's)."""
    port = free_port()
    base = {
        "NATS_URL": nats_url,
        "OMNIRELAY_PIPELINE": str(pipeline),
        "OMNIRELAY_LOG_STATS": "true",
        "OMNIRELAY_METRICS_PORT": str(port),
        "OMNIRELAY_ADMIN_PORT": str(port),
    }
    proc = ServiceProcess(args, {**base, **(env or {})}, log).start()
    proc.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return proc


def write_pipeline(path: Path, name: str, stages_yaml: str, timeout_s: float = 120.0) -> Path:
    """A pipeline file named ``name`` (unique per test module: streams are per pipeline)."""
    path.write_text(
        f"name: {name}\nserved_model_name: {name}-model\nrequest_timeout_s: {timeout_s}\nstages:\n{stages_yaml}"
    )
    return path


THINKER_YAML = """\
  - name: thinker
    type: llm
    model: tiny-thinker
    replicas: 1
    consumes: text
    emits: text
    stream_to_client: true
    engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}
"""
LISTENER_YAML = """\
  - name: listener
    type: asr
    model: whisper-tiny-en
    consumes: audio
    emits: text
    stream_to_client: true
"""


def mock_thinker_yaml(inter_token_ms: float = 0) -> str:
    """A thinker stage on the mock engine (no model computes; the tiny thinker's tokenizer)."""
    return f"""\
  - name: thinker
    type: llm
    model: tiny-thinker
    consumes: text
    emits: text
    stream_to_client: true
    engine: {{max_num_seqs: 16, mock: {{inter_token_ms: {inter_token_ms}}}}}
"""


TALKER_YAML = """\
  - name: talker
    type: llm
    model: tiny-talker
    consumes: text
    emits: codec_codes
    engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}
"""
CODE2WAV_YAML = """\
  - name: code2wav
    type: codec
    model: tiny-code2wav
    consumes: codec_codes
    emits: audio
    stream_to_client: true
"""


def service_pid(root: int, name: str) -> int:
    """The pid of service ``name`` of the process plan (``orchestrator``, ``thinker-1``) under the
    ``omnirelay up`` process ``root``: its forker (:mod:`libs.stack.forker`) titles it
    ``<command line> [<name>]``."""
    found = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_text().rstrip("\0").endswith(f" [{name}]"):
                found.append(pid)
    assert len(found) == 1, (name, found)
    return found[0]


def worker_pid(root: int, stage: int, replica: int) -> int:
    """The pid of the worker (``stage``, ``replica``) of the default pipeline under ``root``."""
    return service_pid(root, f"{load_pipeline().stages[stage].name}-{replica}")


def process_state(pid: int) -> str:
    """The process state letter of ``pid`` (``T`` when stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def kill_confirmed(pid: int, what: str) -> None:
    """``SIGKILL`` ``pid`` and wait up to 5 s until it is gone (a fault test proves its fault
    happened before it judges what the system did)."""
    os.kill(pid, signal.SIGKILL)
    await until(lambda: gone(pid), f"{what} (pid {pid}) gone after SIGKILL", timeout_s=5.0, every_s=0.02)


async def stop_confirmed(pid: int, what: str, timeout_s: float = 2.5) -> None:
    """``SIGSTOP`` ``pid`` and wait up to ``timeout_s`` until its state is ``T`` (stopped). The
    caller sends ``SIGCONT`` in a ``finally`` around this call."""
    os.kill(pid, signal.SIGSTOP)
    await until(lambda: process_state(pid) == "T", f"{what} (pid {pid}) stopped", timeout_s, every_s=0.02)


def gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
