"""compose/: the Compose files are valid, say what the local launcher does, and actually run.

Containers cannot run on the test machines, so the files are held to three checks instead:

1. Schema: docker-compose.yml, the GPU override and their merge validate against the official
   Compose Specification JSON schema (the copy vendored in the ``check-jsonschema`` package), plus
   structural rules the schema cannot express (depends_on targets exist, healthchecks, ports, GPU
   reservations); the images: ``test_compose_images.py``.
2. Equivalence: every omnirelay service's command and environment equal the launcher's process plan
   (``plan_services``) for the same process, given the compose NATS address and in-image pipeline path;
   the only other variables are the documented per-container ones (``COMPOSE_ONLY_VARS``).
3. Native start (``test_compose_native.py``): a real ``nats-server`` plus every omnirelay service of the compose file started as
   ``python -m cli <command>`` with that service's compose environment (NATS address, pipeline
   path, hosts and ports swapped for local ones); the gateway must become healthy, the compose
   healthcheck commands must pass against the processes, and a text+audio chat request must return audio.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from cli.launcher import plan_services
from libs.common.pipeline import load_pipeline
from libs.common.settings import ServiceSettings
from tests import needs
from tests.compose_files import (
    ADMIN_PORT,
    CLUSTER_FILE,
    CLUSTER_NATS_URL,
    COMPOSE_DIR,
    COMPOSE_FILE,
    COMPOSE_NATS_URL,
    COMPOSE_ONLY_VARS,
    DEFAULT_PIPELINE,
    GATEWAY_PORT,
    GPU_FILE,
    IMAGE_HEALTHCHECK,
    IMAGE_PIPELINES_DIR,
    METRICS_PORT,
    NATS_SECRETS_MOUNT,
    PIPELINES_DIR,
    PROMETHEUS_CONFIG,
    REPO,
    as_env,
    interpolate,
    load_compose,
    mount_target,
    omnirelay_services,
    read_yaml,
)

pytestmark = pytest.mark.integration


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
        secrets = [v for v in svc["volumes"] if mount_target(v) == NATS_SECRETS_MOUNT]
        assert secrets == [f"nats-id-{expected[name]}:{NATS_SECRETS_MOUNT}:ro"], name
        assert not [v for v in svc["volumes"] if str(v).startswith("nats-") and v not in secrets], name
    init = model["services"]["nats-init"]
    written = {mount_target(v): str(v).split(":")[0] for v in init["volumes"]}
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
