"""The check, step by step (docs/compose.md, "What `make compose-check` proves"), and its report."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import yaml

from cli.compose_check import probes
from cli.compose_check.engine import NoEngine, compose_command, ensure_engine, log
from cli.compose_check.images import (
    STANDINS,
    build_args,
    choose_base,
    docker_build,
    image_size_mb,
    present,
    pullable,
    standin,
)
from cli.compose_check.project import ComposeProject
from libs.common.pipeline import load_pipeline
from libs.common.subjects import BUCKETS, Subjects, kv_stream
from libs.stack.local_nats import free_port

IMAGE = "omnirelay:cpu"
HEALTHY_S = 900.0
"""How long the stack may take from ``up`` to every container healthy, seconds (vLLM engines start
~20 s each on two cores, longer together)."""
PORT_VARS = ("OMNIRELAY_GATEWAY_PORT", "NATS_PORT", "NATS_MONITOR_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT")
KILLED = "thinker-1"
"""The worker whose container the check kills (the other thinker replica serves meanwhile)."""


def image_vars(compose_file: Path) -> dict[str, str]:
    """Service → the variable that names its image in the file (``${NATS_IMAGE:-nats:...}``)."""
    raw = yaml.safe_load(compose_file.read_text())
    out = {}
    for name, svc in raw["services"].items():
        m = re.fullmatch(r"\$\{(\w+):?-[^}]*\}", str(svc.get("image", "")))
        if m:
            out[name] = m[1]
    return out


def choose_images(stack: ComposeProject, base: str, repo: Path) -> tuple[list[str], list[str]]:
    """Which services run (official image here or pullable, else a stand-in set through the file's
    own ``*_IMAGE`` variable, which this adds to ``stack.env``) and which are left out (no image)."""
    variables = image_vars(stack.directory / "docker-compose.yml")
    run, left_out = [], []
    for name, svc in stack.model()["services"].items():
        if svc.get("profiles"):  # not started by `up` (nats-box: `docker compose run`)
            if not pullable(svc["image"]):
                left_out.append(f"{name} ({svc['image']}; profile {', '.join(svc['profiles'])})")
            continue
        if "build" in svc or pullable(svc["image"]):
            run.append(name)
        elif name in STANDINS:
            stack.env[variables[name]] = standin(name, base, repo)
            log(f"{name}: {svc['image']} cannot be pulled; stand-in {stack.env[variables[name]]}")
            run.append(name)
        else:
            left_out.append(f"{name} ({svc['image']})")
    return run, left_out


def build(repo: Path, base: str, cold: bool, rows: list[tuple[str, str]]) -> None:
    """compose/Dockerfile built on ``base``: once as things stand (from scratch when there is no
    image yet or ``cold``), then again, all from the cache; both timed into ``rows``."""
    args = build_args(base, repo)
    dockerfile = repo / "compose" / "Dockerfile"
    kind = "cold" if cold or not present(IMAGE) else "on the cache as it stands"
    log(f"building {IMAGE}: {kind}")
    rows.append((f"build, {kind}", f"{docker_build(repo, dockerfile, IMAGE, args, no_cache=cold):.0f} s"))
    rows.append(("build, cached", f"{docker_build(repo, dockerfile, IMAGE, args, no_cache=False):.1f} s"))
    rows.append(("image size", f"{image_size_mb(IMAGE):.0f} MB"))
    rows.append(("image", probes.baked_in(IMAGE)))


def exercise(stack: ComposeProject, repo: Path, ports: dict[str, str], rows: list[tuple[str, str]]) -> None:
    """Steps 3 to 8 on ``stack``: up, healthy, traffic, discovery, a NATS restart, a worker killed."""
    pipeline = load_pipeline(repo / "compose" / "pipelines" / "default.yaml")
    url = f"http://127.0.0.1:{ports['OMNIRELAY_GATEWAY_PORT']}"
    t = time.monotonic()
    stack.run("down", "-v", "--remove-orphans", check=False)
    stack.up()
    healthy = stack.wait_healthy(stack.services, HEALTHY_S)
    rows.append(("start to healthy", f"{time.monotonic() - t:.0f} s ({healthy:.0f} s after `up` returned)"))
    log("every container healthy")
    gateway = probes.Gateway(url, stack.api_key())
    model = pipeline.served_model_name
    rows.append(("traffic", asyncio.run(probes.traffic(gateway, model))))
    if "prometheus" in stack.services:
        workers = {(str(s), str(r)) for s, st in enumerate(pipeline.stages) for r in range(st.replicas)}
        prometheus = f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}"
        rows.append(("Prometheus discovery", probes.discovery(prometheus, url, workers, stack)))
    nats_url = f"nats://127.0.0.1:{ports['NATS_PORT']}"
    subjects = Subjects(pipeline.name)
    streams = [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
    streams += [kv_stream(b) for b in BUCKETS]
    rows.append(("restart nats", probes.jetstream_survives_restart(stack, nats_url, gateway, model, streams)))
    outage = probes.worker_dies(stack, KILLED, gateway, model)
    docker_kill = "restarted" if outage.docker_kill_restarted else "not restarted (a manual stop)"
    rows.append(
        (
            f"{KILLED} killed",
            f"docker kill: {docker_kill}; kill -9 of its process: back and healthy in "
            f"{outage.restarted_s:.0f} s, {outage.completed}/{outage.completed} requests meanwhile completed",
        )
    )


def main(repo: Path, cold: bool, keep: bool) -> int:
    """Run the check; 0 when it passed or no Docker engine can run here (said plainly), else 1."""
    work = repo / ".omnirelay" / "compose-check"
    try:
        version = ensure_engine(work)
    except NoEngine as e:
        log(f"SKIPPED: no Docker engine can run here: {e}")
        return 0
    compose = compose_command()
    log(f"Docker Engine {version}; compose command: {' '.join(compose)}")
    rows: list[tuple[str, str]] = [("engine", f"Docker Engine {version}, {' '.join(compose)}")]
    ports = {var: str(free_port()) for var in PORT_VARS}
    env = {
        **ports,
        "OMNIRELAY_IMAGE": IMAGE,
        "OMNIRELAY_LOG_STATS": "true",
        "OMNIRELAY_ALLOW_IGNORE_EOS": "true",
    }
    stack = ComposeProject(compose, repo / "compose", env, [])
    passed = False
    try:
        base, which = choose_base(work)
        log(f"base image: {base} ({which})")
        rows.append(("base image", f"{base} ({which})"))
        build(repo, base, cold, rows)
        stack.services, left_out = choose_images(stack, base, repo)
        rows.append(("left out (no image here)", ", ".join(left_out) or "none"))
        if left_out:
            log(f"left out, no image and no stand-in here: {', '.join(left_out)}")
        exercise(stack, repo, ports, rows)
        passed = True
    except (probes.CheckFailed, RuntimeError, subprocess.TimeoutExpired) as e:
        log(f"FAILED: {e}")
        rows.append(("FAILED", str(e).splitlines()[0]))
    finally:
        if not keep:
            stack.down()
    print("\n| step | result |\n| --- | --- |")
    for step, result in rows:
        print(f"| {step} | {result} |")
    return 0 if passed else 1
