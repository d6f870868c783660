"""Under ``make test`` (``OMNIRELAY_TESTS_NEED_ALL=1``) a test whose dependency is missing fails;
run by hand without it, it is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from libs.stack.forker import FORKER_ENV
from tests import needs

REPO = Path(__file__).parents[2]


def _run(tmp_path: Path, need_all: bool) -> str:
    (tmp_path / "test_module_level.py").write_text(
        'import pytest\npytest.importorskip("no_such_module_xyz")\n\ndef test_a():\n    pass\n'
    )
    (tmp_path / "test_program.py").write_text(
        'from tests import needs\n\ndef test_b():\n    needs.program("no-such-program-xyz", "absent")\n'
    )
    env = {k: v for k, v in os.environ.items() if k != needs.NEED_ALL_ENV}
    env[FORKER_ENV] = "off"  # the inner session starts no service: no forker to import vLLM for it
    if need_all:
        env[needs.NEED_ALL_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


def test_a_missing_dependency_fails_under_make_test(tmp_path: Path) -> None:
    assert _run(tmp_path, need_all=True).startswith("1 failed, 1 error")


def test_a_missing_dependency_skips_when_run_by_hand(tmp_path: Path) -> None:
    assert _run(tmp_path, need_all=False).startswith("2 skipped")
