"""The images of the check: official ones where a registry answers, stand-ins built from Debian's
packages where none does, and the omnirelay image built from compose/Dockerfile on either base.

A stand-in base for ``python:3.11-slim`` is Debian bookworm (``debootstrap --variant=minbase``) with
Debian's CPython 3.11 as a venv at ``/usr/local``: ``python`` and ``pip`` first on PATH, as in the
official image. Stand-ins for ``nats`` and ``prom/prometheus`` are compose/standins/*.Dockerfile on
that base. Grafana, Jaeger, the OTel Collector, the NATS exporter and nats-box have none."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cli.compose_check.engine import apt_install, log, sh

PULL_TIMEOUT_S = 120.0
OFFICIAL_BASE = "python:3.11-slim"
STANDIN_BASE = "omnirelay-standin/python:3.11-bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
STANDIN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "wget", "libnuma1")
STANDIN_PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The stand-in base's PATH: its venv at ``/usr/local`` first, as in the official image."""
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
"""Debian's place for a host's extra CA certificates (e.g. a TLS-intercepting proxy's)."""
LOCAL_WHEELS = Path("/opt/wheels")
"""Where a host may keep a local torch wheel (the Makefile's ``--find-links``)."""
STANDINS = {"nats": "nats.Dockerfile", "prometheus": "prometheus.Dockerfile"}
"""Compose service → the stand-in Dockerfile in compose/standins/ for its image."""


def image_id(image: str) -> str | None:
    """The id of ``image`` here, or None."""
    p = sh("docker", "image", "inspect", "--format", "{{.Id}}", image, check=False, timeout_s=30)
    return p.stdout.strip() if p.returncode == 0 else None


def present(image: str) -> bool:
    return image_id(image) is not None


def pullable(image: str) -> bool:
    """Whether ``image`` is here or can be pulled now."""
    if present(image):
        return True
    try:
        return sh("docker", "pull", "-q", image, check=False, timeout_s=PULL_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def extra_ca_certs() -> str:
    """The host's extra CA certificates (PEM), for the builds' pip and apt."""
    return "".join(p.read_text() for p in sorted(EXTRA_CA_DIR.glob("*.crt"))) if EXTRA_CA_DIR.is_dir() else ""


def standin_base(work: Path) -> str:
    """The Debian stand-in for ``python:3.11-slim`` (built once; kept as ``STANDIN_BASE``)."""
    if present(STANDIN_BASE):
        return STANDIN_BASE
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        root = Path(tmp) / "rootfs"
        t = time.monotonic()
        include = f"--include={','.join(STANDIN_PACKAGES)}"
        sh("debootstrap", "--variant=minbase", include, "bookworm", str(root), DEBIAN_MIRROR, timeout_s=1800)
        sh("chroot", str(root), "python3", "-m", "venv", "/usr/local", timeout_s=300)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        changes = [f"ENV PATH={STANDIN_PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]']
        argv = ["docker", "import", *(arg for c in changes for arg in ("--change", c)), "-", STANDIN_BASE]
        subprocess.run(argv, stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
        log(f"built {STANDIN_BASE} from Debian's packages in {time.monotonic() - t:.0f} s")
    return STANDIN_BASE


def choose_base(work: Path) -> tuple[str, str]:
    """(base image, which one: "official" or "stand-in") for compose/Dockerfile."""
    if pullable(OFFICIAL_BASE):
        return OFFICIAL_BASE, "official"
    return standin_base(work), "stand-in"


def docker_build(context: Path, dockerfile: Path, tag: str, args: dict[str, str], no_cache: bool) -> float:
    """``docker build`` of ``dockerfile`` in ``context``, tagged ``tag``; returns its seconds. The
    image ``tag`` named before is removed when the build replaced it (its layers that are still the
    build cache stay)."""
    argv = ["docker", "build", "-f", str(dockerfile), "-t", tag]
    for k, v in args.items():
        argv += ["--build-arg", f"{k}={v}"]
    argv += ["--no-cache"] if no_cache else []
    before = image_id(tag)
    t = time.monotonic()
    sh(*argv, str(context), timeout_s=3600)
    seconds = time.monotonic() - t
    if before is not None and image_id(tag) != before:
        sh("docker", "image", "rm", before, check=False, timeout_s=120)
    return seconds


def build_args(base: str, repo: Path) -> dict[str, str]:
    """compose/Dockerfile's build arguments for this host: the base, the host's extra CAs, and,
    when the host keeps a local torch wheel, that wheel (linked into compose/wheels/) in place of
    PyTorch's index."""
    args = {"BASE_IMAGE": base, "EXTRA_CA_CERTS": extra_ca_certs()}
    wheels = sorted(LOCAL_WHEELS.glob("torch-*.whl")) if LOCAL_WHEELS.is_dir() else []
    for wheel in wheels:
        target = repo / "compose" / "wheels" / wheel.name
        if not target.exists():
            try:
                target.hardlink_to(wheel)
            except OSError:
                shutil.copy2(wheel, target)
    if wheels:
        args["TORCH_INDEX_URL"] = ""
    return args


def standin(service: str, base: str, repo: Path) -> str:
    """The stand-in image for ``service`` (``STANDINS``), built on ``base``."""
    tag = f"omnirelay-standin/{service}:local"
    dockerfile = repo / "compose" / "standins" / STANDINS[service]
    docker_build(
        dockerfile.parent, dockerfile, tag, {"BASE_IMAGE": base, "EXTRA_CA_CERTS": extra_ca_certs()}, False
    )
    return tag


def image_size_mb(image: str) -> float:
    return int(sh("docker", "image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6
