"""`omnirelay up` runs the gateway and the orchestrator SCHED_BATCH (no preemption on wake-up); the
stage workers keep the policy they were started with (see libs/common/runtime.yield_on_wakeup)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.process_table import descendants

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies"),
]


def test_front_end_services_yield_on_wakeup_and_workers_do_not(stack) -> None:
    policies: dict[str, set[int]] = {}
    for pid in descendants(stack.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").split()
            policy = os.sched_getscheduler(pid)
        except OSError:
            continue
        if "cli" in argv:
            service = argv[argv.index("cli") + 1]
            policies.setdefault(service, set()).add(policy)
    assert policies.get("gateway") == {os.SCHED_BATCH}
    assert policies.get("orchestrator") == {os.SCHED_BATCH}
    assert policies.get("worker") == {os.sched_getscheduler(0)}  # inherited from the launcher, unchanged
