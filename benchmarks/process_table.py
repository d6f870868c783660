"""The machine's processes as psutil and the kernel's CPU clocks show them: a process's
descendants, the CPU a process (or everything this bench did not start) has used, and what else
runs on the machine. Clocks: CPU seconds; :func:`process_cpu_s` reads the kernel's nanosecond
per-process clock, :func:`foreign_cpu_s` psutil's (``/proc``'s ticks).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

ENGINE_TITLE = "VLLM::"
"""How vLLM's engine-side processes begin their title (``VLLM::EngineCore``, ``VLLM::Worker``)."""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...); none when ``pid`` is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _is_omnirelay(cmdline: str) -> bool:
    """An omnirelay process: ``python -m cli ...`` or the ``omnirelay`` console script."""
    args = cmdline.split()
    if "-m" in args[:-1] and args[args.index("-m") + 1] == "cli":
        return True
    return any(Path(arg).name == "omnirelay" for arg in args[:2])


def _is_pytest(cmdline: str) -> bool:
    """A pytest run (``pytest ...``, ``python -m pytest ...``), not a path that mentions it."""
    return any(arg == "pytest" or arg.endswith("/pytest") for arg in cmdline.split())


def _foreign() -> list[psutil.Process]:
    """The processes this bench did not start, with their command line and CPU times read."""
    mine = {os.getpid(), *descendants(os.getpid())}
    return [p for p in psutil.process_iter(["cmdline", "cpu_times"]) if p.pid not in mine]


def machine_activity() -> dict[str, float]:
    """What else runs here now: omnirelay processes (``python -m cli``, ``omnirelay``), pytest
    runs and vLLM engine processes not started by this bench, and the 1-minute load average."""
    foreign = [" ".join(p.info["cmdline"] or []) for p in _foreign()]
    return {
        "foreign_omnirelay": sum(_is_omnirelay(c) for c in foreign),
        "foreign_pytest": sum(_is_pytest(c) for c in foreign),
        "foreign_vllm_engines": sum(c.startswith(f"{ENGINE_TITLE}EngineCore") for c in foreign),
        "loadavg_1m": os.getloadavg()[0],
    }


_CPUCLOCK_SCHED = 2
"""Linux's process-wide CPU clock kind that counts the scheduler's run time in nanoseconds."""


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread, living or exited) process ``pid`` has run so
    far, from the kernel's per-process CPU clock (what glibc's ``clock_getcpuclockid`` names):
    the scheduler's own nanosecond count, not ``/proc``'s 10 ms ticks, so a load of tens of
    milliseconds reads true to the microsecond. Raises ProcessLookupError when ``pid`` is gone."""
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except OSError as e:
        raise ProcessLookupError(pid) from e


def foreign_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) used so far by each process this bench did not start."""
    return {p.pid: t.user + t.system for p in _foreign() if (t := p.info["cpu_times"]) is not None}


def cpu_share_pct(before: dict[int, float], after: dict[int, float], wall_s: float) -> float:
    """CPU used between two :func:`foreign_cpu_s` snapshots, percent of one core over ``wall_s``
    (a process born in between counts whole; one that died in between is not seen)."""
    if wall_s <= 0:
        return 0.0
    used = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return 100.0 * max(used, 0.0) / wall_s
