"""Where the local stack is: the file ``omnirelay up`` writes in its data directory, and how the
other commands choose the NATS they talk to.

``omnirelay up`` starts NATS on free ports, so a command run beside it cannot guess the URL. Once
the stack is up, ``up`` writes ``<data-dir>/stack.json`` (:class:`StackInfo`) atomically and removes
it on a clean stop. A command that needs NATS takes, in order (:func:`resolve_nats_url`): its
``--nats-url`` flag, the ``NATS_URL`` (or ``OMNIRELAY_NATS_URL``) variable, that file under the
data directory if the process that wrote it is still alive, else ``nats://127.0.0.1:4222``.
:func:`probe_nats` tells, within a bound, whether any server of a URL answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import nats
import psutil
from nats.errors import Error as NatsError

from libs.common.bus import server_urls
from libs.common.nats_credentials import NatsAuth, NatsCredentials, auth_from

STACK_FILE = "stack.json"
DEFAULT_DATA_DIR = Path(".omnirelay")
"""``omnirelay up``'s data directory when ``--data-dir`` is not given (relative to the current
directory, like ``make up`` runs it: the checkout's root)."""
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NATS_ENV_VARS = ("NATS_URL", "OMNIRELAY_NATS_URL")
EXPLICIT_SOURCES = ("--nats-url", *NATS_ENV_VARS)
"""The :attr:`NatsTarget.source` values of a URL the command was given (not one it found)."""
PROBE_TIMEOUT_S = 4.0
"""How long :func:`probe_nats` waits for some server of a URL to answer, seconds."""


@dataclass(frozen=True)
class StackInfo:
    """What a running ``omnirelay up`` tells the other commands (the JSON of ``stack.json``)."""

    pid: int
    """The launcher's process id."""
    pid_created: float
    """The launcher's start time (``psutil``'s ``create_time``, seconds since the epoch): a pid
    reused by another process after the launcher died does not pass for it."""
    nats_url: str
    """NATS client URL(s), comma-separated for a cluster."""
    nats_monitor_urls: list[str]
    """The NATS servers' HTTP monitoring URLs (empty when ``up`` was given ``--nats-url``)."""
    gateway_url: str
    """The gateway's base URL (``/v1`` and ``/health`` below it)."""
    pipeline: str
    """The pipeline's name (subjects ``omni.<name>.*``)."""
    pipeline_file: str
    """The pipeline YAML the stack runs, an absolute path."""
    nats_operator_env: dict[str, str] | None = None
    """The environment of a client that connects as the read-only ``operator`` identity
    (``OMNIRELAY_NATS_USER``, ``OMNIRELAY_NATS_PASSWORD_FILE`` and, with TLS, ``OMNIRELAY_NATS_CA``);
    None when ``up`` was given a NATS (it then knows no identities)."""
    gateway_admin_url: str | None = None
    """The gateway's admin listener (``/metrics`` and ``/prometheus/targets`` below it; no API
    key, bound to 127.0.0.1); None in a file written before the admin port existed."""


@dataclass(frozen=True)
class NatsTarget:
    """The NATS URL a command uses and where it came from (said in any error about it)."""

    url: str
    source: str
    credentials: NatsAuth | None = None
    """Who to connect as: the stack file's operator when the URL came from it (and the environment
    names no identity); None: the identity the environment names, if any."""


def stack_file(data_dir: Path) -> Path:
    return data_dir / STACK_FILE


def write_stack_file(data_dir: Path, info: StackInfo) -> Path:
    """Write ``<data_dir>/stack.json`` atomically (a reader sees the old file or the whole new
    one, never a part); returns its path."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = stack_file(data_dir)
    fd, tmp = tempfile.mkstemp(prefix=".stack-", suffix=".json", dir=data_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(info), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def remove_stack_file(data_dir: Path, pid: int) -> None:
    """Remove ``<data_dir>/stack.json`` if process ``pid`` wrote it (another ``up`` that since
    took the data directory keeps its file)."""
    path = stack_file(data_dir)
    info = _read(path)
    if info is not None and info.pid == pid:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _read(path: Path) -> StackInfo | None:
    try:
        return StackInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(info: StackInfo) -> bool:
    try:
        return abs(psutil.Process(info.pid).create_time() - info.pid_created) < 1.0
    except psutil.Error:
        return False


def read_live_stack(data_dir: Path) -> StackInfo | None:
    """The stack described by ``<data_dir>/stack.json``, or None when there is no such file, it
    cannot be read, or the process that wrote it is gone (a stack that was killed leaves a stale
    file behind)."""
    info = _read(stack_file(data_dir))
    return info if info is not None and _alive(info) else None


def resolve_nats_url(flag: str | None, data_dir: Path = DEFAULT_DATA_DIR) -> NatsTarget:
    """The NATS URL a command talks to: ``flag``, else ``NATS_URL`` / ``OMNIRELAY_NATS_URL``, else
    the live stack's file under ``data_dir``, else :data:`DEFAULT_NATS_URL`."""
    if flag:
        return NatsTarget(flag, "--nats-url")
    for var in NATS_ENV_VARS:
        if value := os.environ.get(var):
            return NatsTarget(value, var)
    path = stack_file(data_dir)
    if (info := read_live_stack(data_dir)) is not None:
        operator = info.nats_operator_env
        credentials = None if operator is None or "OMNIRELAY_NATS_USER" in os.environ else auth_from(operator)
        return NatsTarget(info.nats_url, f"{path} (written by `omnirelay up`, pid {info.pid})", credentials)
    return NatsTarget(
        DEFAULT_NATS_URL, f"the default: no --nats-url, no NATS_URL, no running `omnirelay up` ({path})"
    )


async def probe_nats(
    url: str, timeout_s: float = PROBE_TIMEOUT_S, credentials: NatsAuth | None = None
) -> str | None:
    """None if some server of ``url`` accepts a NATS connection (the server's INFO and CONNECT
    exchanged) within ``timeout_s`` in all, as ``credentials`` (default: the identity the
    environment names, if any); else what went wrong (a refused identity: "Authorization
    Violation"). Each server is tried twice at most, with no pause between tries (nats-py's
    ``max_reconnect_attempts=0`` would retry for ever)."""
    try:
        options = (credentials if credentials is not None else NatsCredentials()).connect_options()
    except (ValueError, OSError) as e:  # OMNIRELAY_NATS_* inconsistent, a password file unreadable
        return f"NATS credentials: {e}"
    errors: list[Exception] = []

    async def remember(e: Exception) -> None:
        errors.append(e)

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=server_urls(url),
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                connect_timeout=timeout_s / 2,
                error_cb=remember,
                **options,
            ),
            timeout_s,
        )
    except (OSError, NatsError, TimeoutError) as e:
        return "; ".join(dict.fromkeys(str(x) or type(x).__name__ for x in errors or [e]))
    await nc.close()
    return None


FIND_HINT = (
    "start the stack with `make up` (or `omnirelay up`) in this directory, or name the server with "
    "--nats-url / NATS_URL"
)


def unreachable_message(target: NatsTarget, error: str, hint: str = FIND_HINT) -> str:
    """What a command that cannot reach NATS prints: the URL, where it came from, what to do."""
    return (
        f"error: cannot reach NATS at {target.url} ({error})\n  the URL came from {target.source}\n  {hint}"
    )
