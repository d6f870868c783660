"""The compose project of the check: the user's compose/docker-compose.yml, run with ``docker
compose`` or ``docker-compose`` under its own project name, given only variables the file documents
(images, host ports, ``OMNIRELAY_LOG_STATS``, ``OMNIRELAY_ALLOW_IGNORE_EOS``)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cli.compose_check.engine import log, sh
from libs.common.nats_credentials import NatsAuth, auth_from

GATEWAY_KEY_FILE = "/data/api-key"
"""Where compose's gateway keeps the API key it generated (docker-compose.yml, OMNIRELAY_API_KEYS_FILE)."""
PROJECT = "omnirelay-check"
"""Compose project name of the check (its containers, network and volumes), not the user's."""
ONE_SHOT = ("nats-init",)
"""Services that run once, before the others (``completed`` once they exited with status 0)."""
NATS_SECRETS = "/run/nats"
"""Where a service's NATS identity volume is mounted (docker-compose.yml)."""


@dataclass
class ComposeProject:
    compose: list[str]
    """``docker compose`` or ``docker-compose``."""
    directory: Path
    """compose/ (docker-compose.yml and its .env)."""
    env: dict[str, str]
    """Variables given to compose."""
    services: list[str]
    """The services this check starts."""

    def run(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {"COMPOSE_PROJECT_NAME": PROJECT, **self.env}
        return sh(*self.compose, *args, cwd=self.directory, env=env, timeout_s=timeout_s, check=check)

    def model(self) -> dict[str, Any]:
        """The file as compose reads it (``config``: merged, interpolated)."""
        return yaml.safe_load(self.run("config").stdout)

    def up(self) -> None:
        self.run("up", "-d", "--no-build", *self.services, timeout_s=900)

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).stdout.split()
        if len(ids) != 1:
            raise RuntimeError(f"{service}: {len(ids)} containers")
        return ids[0]

    def state(self, service: str) -> dict[str, Any]:
        """``docker inspect``'s State of the service's container."""
        out = sh("docker", "inspect", "--format", "{{json .State}}", self.container(service)).stdout
        return yaml.safe_load(out)

    def restart_count(self, service: str) -> int:
        return int(sh("docker", "inspect", "--format", "{{.RestartCount}}", self.container(service)).stdout)

    def health(self, service: str) -> str:
        """``healthy``/``starting``/``unhealthy``, or the container status where it has no check."""
        state = self.state(service)
        if service in ONE_SHOT and state["Status"] == "exited" and state.get("ExitCode") == 0:
            return "completed"
        return (state.get("Health") or {}).get("Status") or state["Status"]

    def wait_healthy(self, services: list[str], timeout_s: float) -> float:
        """Seconds until every one of ``services`` is healthy; raises with their logs on timeout or
        an unhealthy container."""
        t0 = time.monotonic()
        while True:
            states = {s: self.health(s) for s in services}
            if all(v in ("healthy", "running", "completed") for v in states.values()):
                return time.monotonic() - t0
            bad = [s for s, v in states.items() if v in ("unhealthy", "exited", "dead")]
            if bad or time.monotonic() - t0 > timeout_s:
                logs = "\n".join(f"--- {s}\n{self.logs(s, 40)}" for s in bad or services)
                raise RuntimeError(f"not healthy after {time.monotonic() - t0:.0f} s: {states}\n{logs}")
            time.sleep(2)

    def api_key(self) -> str:
        """The API key the gateway generated into its volume at first start (what an operator
        reads with ``docker compose exec gateway cat /data/api-key``)."""
        text = self.run("exec", "-T", "gateway", "cat", GATEWAY_KEY_FILE).stdout
        keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        if len(keys) != 1:
            raise RuntimeError(f"gateway: {GATEWAY_KEY_FILE} holds {len(keys)} keys, not 1")
        return keys[0]

    def nats_auth(self, service: str) -> NatsAuth:
        """``service``'s NATS identity, password and CA (read from its volume with ``docker compose
        exec``, kept in a private temporary directory), for a client on the host."""
        user = self.run("exec", "-T", service, "printenv", "OMNIRELAY_NATS_USER").stdout.strip()
        here = Path(tempfile.mkdtemp(prefix="omnirelay-check-nats-"))
        for name in ("password", "ca.pem"):
            (here / name).write_text(self.run("exec", "-T", service, "cat", f"{NATS_SECRETS}/{name}").stdout)
            (here / name).chmod(0o600)
        return auth_from(
            {
                "OMNIRELAY_NATS_USER": user,
                "OMNIRELAY_NATS_PASSWORD_FILE": str(here / "password"),
                "OMNIRELAY_NATS_CA": str(here / "ca.pem"),
            }
        )

    def logs(self, service: str, tail: int) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def down(self) -> None:
        log("tearing down (docker compose down -v)")
        self.run("down", "-v", "--remove-orphans", timeout_s=300, check=False)
