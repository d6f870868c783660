"""The layer rules of docs/architecture.md, as ``import-linter`` contracts (pyproject.toml): they
hold on this tree, and each one fails when a violation is planted in a copy of it."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import services.stage_worker

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("libs", "services", "cli", "benchmarks", "tests")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def contract(name_start: str) -> str:
    (name,) = [c["name"] for c in contracts() if c["name"].startswith(name_start)]
    return name


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages of ``tree`` (and not on the installed checkout)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def broken(result: subprocess.CompletedProcess[str]) -> set[str]:
    """Names of the contracts the run reports broken (its summary puts BROKEN after each name,
    wrapping long names over two lines)."""
    text = " ".join(result.stdout.split())
    return {c["name"] for c in contracts() if f"{' '.join(c['name'].split())} BROKEN" in text}


def test_the_tree_keeps_every_layer_rule() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in result.stdout


def test_the_engine_contract_names_every_worker_process_module() -> None:
    """A worker-process module added later must be added to the engine package's forbidden list."""
    (engine,) = [c for c in contracts() if c.get("source_modules") == ["services.stage_worker.engine_core"]]
    worker_modules = {
        f"services.stage_worker.{m.name}"
        for m in pkgutil.iter_modules(services.stage_worker.__path__)
        if m.name != "engine_core"
    }
    assert worker_modules, "no worker-process modules found"
    assert worker_modules <= set(engine["forbidden_modules"])


PLANTED = {
    "engine-process code imports nothing": (
        "services/stage_worker/engine_core/wait_plugin.py",
        "from services.stage_worker import request_context",
    ),
    "gateway, orchestrator and stage worker": (
        "services/gateway/routes.py",
        "from services.orchestrator import routing",
    ),
    "libs is the bottom layer": ("libs/common/subjects.py", "import benchmarks.harness"),
    "the services and their contract import no stack tooling": (
        "libs/common/bus.py",
        "from libs.stack import local_nats",
    ),
    "services import no operator tools": ("services/orchestrator/routing.py", "from cli import launcher"),
    "benchmarks import neither operator tools": ("benchmarks/bus_hop.py", "from cli import bus_inspect"),
    "the command line imports of tests only": ("cli/launcher.py", "from tests import procs"),
    # the circle this layout removed: the handler factory and a handler importing each other
    "no import cycles": (
        "services/stage_worker/handlers/base.py",
        "def _factory():\n    from services.stage_worker.handlers import code2wav\n",
    ),
}


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", tree)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.txt"))
    return tree


@pytest.mark.parametrize("name_start", sorted(PLANTED))
def test_a_planted_violation_breaks_its_contract(tree_copy: Path, name_start: str) -> None:
    path, line = PLANTED[name_start]
    target = tree_copy / path
    original = target.read_text()
    target.write_text(original + "\n" + line + "\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0, result.stdout
    assert contract(name_start) in broken(result), result.stdout
