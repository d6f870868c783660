"""`omnirelay compose-check`'s reading of the compose file: which variable names each service's
image (the only thing the check overrides), and stand-ins that fit the services they replace."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cli.compose_check.images import STANDINS
from cli.compose_check.run import PORT_VARS, image_vars

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"


def test_every_service_image_is_named_by_a_documented_variable() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    variables = image_vars(COMPOSE_FILE)
    assert variables.keys() == services.keys(), "every image can be replaced through a variable"
    assert variables["nats"] == "NATS_IMAGE" and variables["prometheus"] == "PROMETHEUS_IMAGE"
    assert {v for k, v in variables.items() if "build" in services[k]} == {"OMNIRELAY_IMAGE"}
    guide = (COMPOSE_DIR.parent / "docs" / "compose.md").read_text()
    for var in {*variables.values(), *PORT_VARS}:
        assert f"`{var}`" in guide, f"{var} is not in docs/compose.md's settings"


def test_standins_run_as_the_services_they_replace() -> None:
    """A stand-in is started with the service's own entrypoint and command and checked by its own
    healthcheck: NATS gets ``nats-server`` as the entrypoint from the file, Prometheus only flags
    (the image's entrypoint must be the server); both checks use wget."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for service, dockerfile in STANDINS.items():
        text = (COMPOSE_DIR / "standins" / dockerfile).read_text()
        assert "ARG BASE_IMAGE" in text and "FROM ${BASE_IMAGE}" in text, dockerfile
        assert re.search(r"apt-get install [^\n]*\bwget\b", text), f"{dockerfile}: wget for the healthcheck"
        assert "wget" in services[service]["healthcheck"]["test"]
        entrypoint = re.search(r"^ENTRYPOINT \[\"([^\"]+)\"\]", text, re.M)[1]
        given = services[service].get("entrypoint")
        if given:
            assert Path(entrypoint).name == given[0], service
        else:
            assert all(str(a).startswith("--") for a in services[service]["command"]), service
            assert Path(entrypoint).name == "prometheus", service
