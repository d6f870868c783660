"""What a test needs from the machine (a module, a program). Run by ``make test`` (which installs
every one of them and sets ``OMNIRELAY_TESTS_NEED_ALL=1``) a missing need fails the test; run
another way, it skips it with the reason. Spec-critical tests must not pass silently in CI on a
machine that lacks what they check with. A module-level ``pytest.importorskip`` (a test module
that needs vLLM) is made a failure the same way by ``tests/conftest.py``."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

NEED_ALL_ENV = "OMNIRELAY_TESTS_NEED_ALL"


def _missing(why: str) -> None:
    if os.environ.get(NEED_ALL_ENV) == "1":
        pytest.fail(f"{why} (required: {NEED_ALL_ENV}=1)", pytrace=False)
    pytest.skip(why)


def module(name: str, why: str = "") -> ModuleType:
    """Import ``name``; if it is not installed, fail or skip (see the module's docstring)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(why or f"{name} is not installed")
        raise  # not reached: fail and skip raise


def program(name: str, why: str) -> str:
    """The path of program ``name`` on PATH; if there is none, fail or skip."""
    path = shutil.which(name)
    if path is None:
        _missing(why)
        raise AssertionError(why)  # not reached
    return path
