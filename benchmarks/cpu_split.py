"""Where a benchmark run's CPU went, per output token: the target's front end (every process of
its tree that is not a vLLM engine process, plus what it needs and did not start, such as
omnirelay's nats-server), its engine processes (``VLLM::EngineCore``, ``VLLM::Worker``) and the
load client. Each process's CPU is read from the kernel's per-process clock
(:func:`~benchmarks.process_table.process_cpu_s`), the client's from ``getrusage(RUSAGE_CHILDREN)``
(a child counts once waited for); :func:`cpu_per_token` is a pure function of two snapshots.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.process_table import ENGINE_TITLE, descendants, process_cpu_s

FRONT_END_KEY = "front_end_cpu_us_per_token"
ENGINE_KEY = "engine_cpu_us_per_token"
CLIENT_KEY = "client_cpu_us_per_token"
PROCESS_KEY_PREFIX = "cpu_us_per_token:"
"""Followed by a :func:`process_label`: that kind of process's CPU per token."""


@dataclass(frozen=True)
class ProcessCpu:
    """One process's CPU clock at a snapshot."""

    label: str
    """What kind of process it is (:func:`process_label`)."""
    cpu_s: float
    """CPU seconds it has run so far."""

    @property
    def engine(self) -> bool:
        """A vLLM engine process (its title begins with :data:`~benchmarks.harness.ENGINE_TITLE`)."""
        return self.label.startswith(ENGINE_TITLE)


def label_of(comm: str, argv: Sequence[str]) -> str:
    """A process's kind from its ``comm`` and command line: vLLM's engine processes by their
    title (``VLLM::EngineCore``), an omnirelay service by its subcommand (``python -m cli
    gateway`` → ``gateway``), another Python module by its last name (``python -m
    vllm.entrypoints.openai.api_server`` → ``api_server``), anything else by its program's name
    (``nats-server``)."""
    if not argv:
        return comm
    if comm.startswith(ENGINE_TITLE):
        return argv[0].split()[0]  # its title, which ``comm`` cuts at 15 characters
    if Path(argv[0]).name.startswith("python") and "-m" in argv[:-1]:
        i = argv.index("-m") + 1
        if argv[i] == "cli" and i + 1 < len(argv):
            return argv[i + 1]
        return argv[i].rsplit(".", 1)[-1]
    return Path(argv[0]).name


def process_label(pid: int) -> str:
    """:func:`label_of` a running process (its pid when it is gone)."""
    try:
        p = psutil.Process(pid)
        return label_of(p.name(), " ".join(p.cmdline()).split())  # a forked service's title is one string
    except psutil.Error:
        return str(pid)


def snapshot(roots: Sequence[int]) -> dict[int, ProcessCpu]:
    """pid → :class:`ProcessCpu` for every process in the trees under ``roots`` (the roots
    included); processes that end while being read are left out."""
    out: dict[int, ProcessCpu] = {}
    for root in roots:
        for pid in [root, *descendants(root)]:
            with contextlib.suppress(ProcessLookupError):
                out[pid] = ProcessCpu(process_label(pid), process_cpu_s(pid))
    return out


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_per_token(
    before: dict[int, ProcessCpu],
    after: dict[int, ProcessCpu],
    client_s: float,
    tokens: int,
) -> dict[str, float]:
    """CPU microseconds per output token between two :func:`snapshot` s of a run that produced
    ``tokens`` output tokens, by role (``FRONT_END_KEY``, ``ENGINE_KEY``, ``CLIENT_KEY``) and by
    kind of process (``PROCESS_KEY_PREFIX`` + label);
    ``client_s`` is the client's CPU seconds over the run. A process born during the run counts
    whole; one that ended during it is not seen (its share is lost, never invented). Empty when
    no token came out."""
    if tokens <= 0:
        return {}
    per = 1e6 / tokens
    out = {FRONT_END_KEY: 0.0, ENGINE_KEY: 0.0, CLIENT_KEY: client_s * per}
    for pid, now in after.items():
        used = (now.cpu_s - (before[pid].cpu_s if pid in before else 0.0)) * per
        out[ENGINE_KEY if now.engine else FRONT_END_KEY] += used
        key = PROCESS_KEY_PREFIX + now.label
        out[key] = out.get(key, 0.0) + used
    return out
