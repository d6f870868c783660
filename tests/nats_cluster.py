"""A 3-node JetStream cluster of real nats-servers for the tests (``libs.stack.local_nats``,
``sync_interval`` ``always``), as ``omnirelay up --nats-nodes 3`` starts it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from libs.stack.local_nats import ClusterNode, cluster_argvs, cluster_nodes, raise_broker_share

HEALTHY_TIMEOUT_S = 20.0
"""How long each node may take to answer ``/healthz`` with 200 after the start, seconds."""


@dataclass
class Node:
    spec: ClusterNode
    proc: subprocess.Popen[bytes]


def healthy(node: ClusterNode) -> bool:
    """Whether the node's JetStream is healthy (``/healthz`` 200)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{node.monitor_url}/healthz", timeout=1).status_code == 200
    return False


def node_of(cluster: list[Node], name: str) -> Node:
    """The node named ``name`` (a stream's leader, as ``stream_info`` names it)."""
    (node,) = [n for n in cluster if n.spec.name == name]
    return node


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[Node]]:
    """Three nats-servers forming cluster ``omnirelay`` on free loopback ports, each JetStream
    healthy before the test starts."""
    specs = cluster_nodes(tmp_path, 3)
    nodes = []
    for spec, argv in zip(specs, cluster_argvs(specs, "always"), strict=True):
        with (tmp_path / f"{spec.name}.log").open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            raise_broker_share(proc.pid)
            nodes.append(Node(spec, proc))
    try:
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        for node in nodes:
            while not healthy(node.spec):
                assert node.proc.poll() is None, (tmp_path / f"{node.spec.name}.log").read_text()
                assert time.monotonic() < deadline, f"{node.spec.name} not healthy"
                time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.terminate()
                node.proc.wait(10)
