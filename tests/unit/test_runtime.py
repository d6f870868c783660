"""The service runtime's scheduling switch, checked in a child process (the policy is per process
and inherited; the test process keeps its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")

CHILD = """
import json, os, threading
from libs.common.runtime import yield_on_wakeup
done = yield_on_wakeup({enabled})
seen = {{}}
t = threading.Thread(target=lambda: seen.update(thread=os.sched_getscheduler(0)))
t.start(); t.join()
print(json.dumps({{"done": done, "main": os.sched_getscheduler(0), **seen}}))
"""


def _child(enabled: bool) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(enabled=enabled)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_enabled_switches_the_process_and_the_threads_it_starts_to_batch() -> None:
    assert _child(True) == {"done": True, "main": os.SCHED_BATCH, "thread": os.SCHED_BATCH}


def test_disabled_leaves_the_default_policy() -> None:
    assert _child(False) == {"done": False, "main": os.SCHED_OTHER, "thread": os.SCHED_OTHER}
