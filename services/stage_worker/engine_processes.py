"""An ``llm`` worker's ``/metrics`` also covers its engine's processes (``ProcessCollector`` under
the namespaces of :data:`~libs.common.metrics_catalog.ENGINE_PROCESSES`)."""

from __future__ import annotations

import contextlib
import functools

import psutil
from prometheus_client.process_collector import ProcessCollector

from libs.common.metrics_catalog import ENGINE_PROCESSES, OMNI_REGISTRY

MISSING = "missing"
"""The pid answered when there is no such process (``/proc/missing`` does not exist)."""
COMM_LEN = 15
"""A process name as the kernel keeps it (``/proc/<pid>/comm``) is cut to this many characters."""


class ChildByTitle:
    """The pid of this process's nearest descendant whose name starts with ``title``."""

    def __init__(self, title: str) -> None:
        self._title = title
        self._proc: psutil.Process | None = None

    def __call__(self) -> int | str:
        p = self._proc
        if p is not None and p.is_running():
            return p.pid
        self._proc = None
        level = [psutil.Process()]
        while level:  # nearest generation first
            children: list[psutil.Process] = []
            for parent in level:
                with contextlib.suppress(psutil.Error):
                    children += parent.children()
            for child in children:
                with contextlib.suppress(psutil.Error):
                    if child.name().startswith(self._title[:COMM_LEN]):
                        self._proc = child
                        return child.pid
            level = children
        return MISSING


@functools.cache
def export_engine_processes() -> None:
    """Register the engine process families on :data:`OMNI_REGISTRY` (once per process)."""
    for namespace, title in ENGINE_PROCESSES.items():
        ProcessCollector(namespace=namespace, pid=ChildByTitle(title), registry=OMNI_REGISTRY)
