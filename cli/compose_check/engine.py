"""A Docker engine and a compose command for the check: the running engine, else Debian's
``docker.io`` started here (installed first when missing, as root); ``docker compose`` (v2) when the
CLI has it, else ``docker-compose`` (1.29, Debian's ``docker-compose``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ENGINE_START_S = 60.0
"""How long a started ``dockerd`` may take to answer, seconds."""


class NoEngine(RuntimeError):
    """No Docker engine runs here and none could be started (the message says why)."""


def sh(
    *argv: str,
    timeout_s: float | None = None,
    check: bool = True,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (in ``cwd``, with ``env`` added to this process's environment), its output
    captured as text; ``check``: raise with that output on failure."""
    full_env = {**os.environ, **env} if env else None
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=full_env)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return p


def log(message: str) -> None:
    print(f"[compose-check] {message}", flush=True)


def engine_answers() -> bool:
    return (
        shutil.which("docker") is not None
        and sh("docker", "info", "--format", "{{.ServerVersion}}", check=False, timeout_s=30).returncode == 0
    )


def apt_install(*packages: str) -> None:
    """Debian packages, as root (``apt-get``); raises when that cannot be done here."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise NoEngine(f"{', '.join(packages)} missing and not installable here (needs root and apt-get)")
    log(f"installing Debian packages: {' '.join(packages)}")
    sh("apt-get", "update", "-q", timeout_s=600)
    argv = ("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages)
    p = sh(*argv, check=False, timeout_s=1200, env={"DEBIAN_FRONTEND": "noninteractive"})
    if p.returncode != 0:
        raise NoEngine(f"apt-get install {' '.join(packages)} failed:\n{(p.stdout + p.stderr)[-2000:]}")


def ensure_engine(log_dir: Path) -> str:
    """The engine's version, starting ``dockerd`` (log in ``log_dir``) if none answers."""
    if not engine_answers():
        if shutil.which("dockerd") is None or shutil.which("docker") is None:
            apt_install("docker.io")
        if os.geteuid() != 0:
            raise NoEngine("no Docker engine answers, and starting dockerd needs root")
        log_dir.mkdir(parents=True, exist_ok=True)
        out = (log_dir / "dockerd.log").open("ab")
        log(f"starting dockerd (log: {log_dir / 'dockerd.log'})")
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ENGINE_START_S
        while not engine_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (log_dir / "dockerd.log").read_text(errors="replace")[-2000:]
                raise NoEngine(f"dockerd did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(1)
    return sh("docker", "info", "--format", "{{.ServerVersion}}").stdout.strip()


def compose_command() -> list[str]:
    """``docker compose`` if the CLI has the v2 plugin, else ``docker-compose`` (installed from
    Debian's packages when missing)."""
    if sh("docker", "compose", "version", check=False, timeout_s=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        apt_install("docker-compose")
    return ["docker-compose"]
