"""NATS servers as ``omnirelay up`` configures them: the ``sync_interval`` check, a cluster node's
configuration, the server list of ``NATS_URL`` and the replicas it implies (pure; the running
cluster is ``tests/integration/test_nats_cluster.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from cli.main import app
from libs.common.bus import MAX_REPLICAS, replicas_for, server_urls
from libs.common.settings import ServiceSettings
from libs.stack.local_nats import (
    ClusterNode,
    check_sync_interval,
    client_urls,
    cluster_config,
    nats_server_argv,
)


@pytest.mark.parametrize("value", ["always", "1s", "500ms", "2m", "1h"])
def test_sync_intervals_nats_accepts_pass(value: str) -> None:
    assert check_sync_interval(value) == value


@pytest.mark.parametrize("value", ["", "0s", "1", "1 s", "sometimes", "-1s", "1.5s"])
def test_other_sync_intervals_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="not 'always'"):
        check_sync_interval(value)


def test_a_single_server_gets_its_sync_interval_from_a_config_file(tmp_path: Path) -> None:
    argv = nats_server_argv(tmp_path, 4222, 8222, "always")
    conf = Path(argv[argv.index("-c") + 1])
    assert conf.parent == tmp_path and "sync_interval: always" in conf.read_text()
    assert "-c" not in nats_server_argv(tmp_path, 4222, 8222)  # nats-server's default (tests)


def test_a_cluster_node_routes_to_every_node_and_names_itself(tmp_path: Path) -> None:
    nodes = [
        ClusterNode(f"nats-{i}", tmp_path / f"nats-{i}", 4000 + i, 6000 + i, 8000 + i) for i in (1, 2, 3)
    ]
    conf = cluster_config(nodes[1], nodes, "1s")
    assert "server_name: nats-2\n" in conf and "listen: 127.0.0.1:4002\n" in conf
    assert "http: 127.0.0.1:8002\n" in conf and "sync_interval: 1s\n" in conf
    assert f'store_dir: "{tmp_path / "nats-2"}"' in conf
    assert [f"nats-route://127.0.0.1:{6000 + i}" in conf for i in (1, 2, 3)] == [True] * 3
    assert "listen: 127.0.0.1:6002\n" in conf and "name: omnirelay\n" in conf
    assert client_urls(nodes) == "nats://127.0.0.1:4001,nats://127.0.0.1:4002,nats://127.0.0.1:4003"


def test_nats_url_lists_servers_and_implies_one_replica_each() -> None:
    assert server_urls("nats://a:4222") == ["nats://a:4222"]
    assert server_urls(" nats://a:1, nats://b:2 ,,nats://c:3") == ["nats://a:1", "nats://b:2", "nats://c:3"]
    assert replicas_for(["nats://a:1"]) == 1
    assert replicas_for(["nats://a:1", "nats://b:2", "nats://c:3"]) == 3
    assert replicas_for(["nats://a:1", "nats://a:1"]) == 1  # the same server twice is one server
    assert replicas_for([f"nats://h{i}:4222" for i in range(7)]) == MAX_REPLICAS
    with pytest.raises(ValueError, match="no NATS server"):
        server_urls(" , ")


def test_settings_refuse_a_nats_url_without_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://a:1,nats://b:2")
    assert ServiceSettings().nats_url == "nats://a:1,nats://b:2"
    monkeypatch.setenv("NATS_URL", ",")
    with pytest.raises(ValidationError, match="no NATS server"):
        ServiceSettings()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nats-nodes", "2"], "--nats-nodes: 1, 3 or 5"),
        (["--nats-sync-interval", "soon"], "--nats-sync-interval"),
        (["--nats-nodes", "3", "--nats-url", "nats://a:1"], "--nats-url"),
    ],
)
def test_up_refuses_bad_nats_flags_before_starting_anything(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["up", *args], env={"NATS_URL": ""})
    assert result.exit_code == 2
    assert message in result.output
