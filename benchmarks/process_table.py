"""The machine's processes as ``/proc`` and the kernel's CPU clocks show them: the process table,
a process's descendants, the CPU a process (or everything this bench did not start) has used, and
what else runs on the machine. Clocks: CPU seconds; :func:`process_cpu_s` reads the kernel's
nanosecond per-process clock, :class:`ProcInfo` ``/proc``'s ticks.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_TITLE = "VLLM::"
"""How vLLM's engine-side processes begin their title (``VLLM::EngineCore``, ``VLLM::Worker``)."""


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about one process."""

    ppid: int
    cmdline: str
    cpu_s: float
    """User + system CPU time so far, seconds."""


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, ProcInfo]:
    """pid → :class:`ProcInfo` of every process visible in /proc."""
    table: dict[int, ProcInfo] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cpu = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
            table[int(entry.name)] = ProcInfo(int(fields[1]), cmd, cpu)
    return table


def descendants(pid: int, table: dict[int, ProcInfo] | None = None) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    table = table if table is not None else _proc_table()
    children: dict[int, list[int]] = {}
    for p, info in table.items():
        children.setdefault(info.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_omnirelay(cmdline: str) -> bool:
    """An omnirelay process: ``python -m cli ...`` or the ``omnirelay`` console script."""
    args = cmdline.split()
    if "-m" in args[:-1] and args[args.index("-m") + 1] == "cli":
        return True
    return any(Path(arg).name == "omnirelay" for arg in args[:2])


def _is_pytest(cmdline: str) -> bool:
    """A pytest run (``pytest ...``, ``python -m pytest ...``), not a path that mentions it."""
    return any(arg == "pytest" or arg.endswith("/pytest") for arg in cmdline.split())


def _foreign(table: dict[int, ProcInfo]) -> dict[int, ProcInfo]:
    """The processes this bench did not start."""
    mine = {os.getpid(), *descendants(os.getpid(), table)}
    return {pid: info for pid, info in table.items() if pid not in mine}


def machine_activity() -> dict[str, float]:
    """What else runs here now: omnirelay processes (``python -m cli``, ``omnirelay``), pytest
    runs and vLLM engine processes not started by this bench, and the 1-minute load average."""
    foreign = [info.cmdline for info in _foreign(_proc_table()).values()]
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
    """CPU seconds used so far by each process this bench did not start."""
    return {pid: info.cpu_s for pid, info in _foreign(_proc_table()).items()}


def cpu_share_pct(before: dict[int, float], after: dict[int, float], wall_s: float) -> float:
    """CPU used between two :func:`foreign_cpu_s` snapshots, percent of one core over ``wall_s``
    (a process born in between counts whole; one that died in between is not seen)."""
    if wall_s <= 0:
        return 0.0
    used = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return 100.0 * max(used, 0.0) / wall_s
