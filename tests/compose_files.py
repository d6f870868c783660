"""The compose files as docker compose reads them, for the compose tests: where they are, the
values the images and services share with them, interpolation and override merging as Compose
does them, and the omnirelay services of a merged model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
GPU_FILE = COMPOSE_DIR / "docker-compose.gpu.yml"
CLUSTER_FILE = COMPOSE_DIR / "docker-compose.cluster.yml"
CLUSTER_NATS_URL = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"
PIPELINES_DIR = COMPOSE_DIR / "pipelines"
DEFAULT_PIPELINE = PIPELINES_DIR / "default.yaml"
HEALTHCHECK_SCRIPT = COMPOSE_DIR / "healthcheck.py"

IMAGE_PIPELINES_DIR = "/opt/omnirelay/pipelines"
IMAGE_HEALTHCHECK = "/opt/omnirelay/healthcheck.py"
NATS_CONF = "/etc/nats/omnirelay.conf"
COMPOSE_NATS_URL = "nats://nats:4222"
GATEWAY_PORT = 8000
ADMIN_PORT = 8001
"""The gateway's admin port in compose: /metrics and /prometheus/targets (the launcher picks any)."""
METRICS_PORT = 9100
PROMETHEUS_CONFIG = COMPOSE_DIR / "prometheus.yml"
OMNIRELAY_COMMANDS = {"orchestrator", "worker", "gateway"}

# Variables a compose service sets beyond the launcher's plan, and why:
#   OMNIRELAY_ADVERTISE_HOST  the container's compose host name (what others and Prometheus dial)
#   OMNIRELAY_METRICS_PORT    fixed /metrics port of orchestrator and workers (the launcher picks any)
#   OMNIRELAY_METRICS_HOST    their /metrics binds all interfaces inside the container (Prometheus)
#   OMNIRELAY_HOST            the gateway binds all interfaces inside its container
#   OMNIRELAY_METRICS_HOST    (gateway) its admin port binds all interfaces inside the container (Prometheus)
#   OMNIRELAY_API_KEYS*, OMNIRELAY_GENERATE_API_KEY  the gateway's keys: given, or generated into its volume
#   OMNIRELAY_ALLOW_IGNORE_EOS  user switch: vLLM's ignore_eos on the gateway's public port
#   OMNIRELAY_LOG_LEVEL       user switch; its default is the services' own default
#   OMNIRELAY_NATS_*          the service's NATS identity and its secrets (nats-init's volume; the
#                             launcher gives the same variables to the processes it starts)
#   OTEL_EXPORTER_OTLP_*      traces to the compose OTel collector (the launcher leaves tracing to the user)
OTEL_VARS = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"}
METRICS_VARS = {"OMNIRELAY_METRICS_PORT", "OMNIRELAY_METRICS_HOST"}
NATS_IDENTITY_VARS = {"OMNIRELAY_NATS_USER", "OMNIRELAY_NATS_PASSWORD_FILE", "OMNIRELAY_NATS_CA"}
NATS_SECRETS_MOUNT = "/run/nats"
API_KEY_VARS = {
    "OMNIRELAY_API_KEYS",
    "OMNIRELAY_API_KEYS_FILE",
    "OMNIRELAY_GENERATE_API_KEY",
    "OMNIRELAY_ALLOW_IGNORE_EOS",
}
COMPOSE_ONLY_VARS = {
    "orchestrator": {
        "OMNIRELAY_ADVERTISE_HOST",
        *METRICS_VARS,
        "OMNIRELAY_LOG_LEVEL",
        *OTEL_VARS,
        *NATS_IDENTITY_VARS,
    },
    "worker": {
        "OMNIRELAY_ADVERTISE_HOST",
        *METRICS_VARS,
        "OMNIRELAY_LOG_LEVEL",
        *OTEL_VARS,
        *NATS_IDENTITY_VARS,
    },
    "gateway": {
        "OMNIRELAY_ADVERTISE_HOST",
        "OMNIRELAY_HOST",
        "OMNIRELAY_METRICS_HOST",
        *API_KEY_VARS,
        "OMNIRELAY_LOG_LEVEL",
        *OTEL_VARS,
        *NATS_IDENTITY_VARS,
    },
}

HEALTHY_TIMEOUT_S = 240.0
CHAT_TIMEOUT_S = 120.0


# --- reading compose files the way docker compose does --------------------------------------------
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose variable substitution (``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}``) on every string value, keys untouched."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["named"]
        op, arg = m["op"], m["arg"] or ""
        assert "$" not in arg, f"nested interpolation is not supported here: {m[0]}"
        is_set, current = name in env, env.get(name, "")
        present = bool(current) if op and op.startswith(":") else is_set
        match (op or "").lstrip(":"):
            case "-":
                return current if present else arg
            case "?":
                if not present:
                    raise ValueError(f"required variable {name} is missing: {arg}")
                return current
            case "+":
                return arg if present else ""
            case _:
                return current

    return _INTERPOLATION.sub(one, value)


_OVERRIDE_LISTS = {"command", "entrypoint", "test"}


def mount_target(volume: str) -> str:
    return volume.split(":")[1]


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's multi-file merge as far as these files need it: mappings merge key by key,
    command/entrypoint/healthcheck test are replaced, volumes merge by their path in the container,
    other sequences are appended without duplicates."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if key == "volumes" and isinstance(base, list) and isinstance(override, list):
        replaced = {mount_target(v) for v in override}
        return [v for v in base if mount_target(v) not in replaced] + override
    if isinstance(base, list) and isinstance(override, list) and key not in _OVERRIDE_LISTS:
        return base + [v for v in override if v not in base]
    return override


def read_yaml(path: Path) -> dict[str, Any]:
    """YAML with anchors and ``<<`` merge keys resolved (PyYAML does both, as compose does)."""
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_compose(*files: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The merged, interpolated model of ``files``; ``env`` stands in for the shell (default: empty)."""
    model: dict[str, Any] = {}
    for f in files:
        model = merge(model, read_yaml(f))
    return interpolate(model, env or {})


def omnirelay_services(model: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Services running an omnirelay subcommand (the image's entrypoint is ``omnirelay``)."""
    return {
        name: svc
        for name, svc in model["services"].items()
        if isinstance(svc.get("command"), list)
        and svc["command"][:1]
        and svc["command"][0] in OMNIRELAY_COMMANDS
    }


def as_env(environment: Any) -> dict[str, str]:
    """A service's ``environment`` (mapping or ``KEY=VALUE`` list) as strings."""
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {
        k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in environment.items()
    }
