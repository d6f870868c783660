"""The interface between the worker's bus plumbing and what a stage computes."""

from __future__ import annotations

from abc import ABC, abstractmethod

from nats.js.kv import KeyValue

from libs.common.envelopes import StageTask
from services.stage_worker.progress import EngineProgress
from services.stage_worker.request_context import RequestContext


class StageError(Exception):
    """A failure a handler can name: the client gets ``status`` and ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class StageHandler(ABC):
    """Runs one stage's engine in the worker process. ``start`` once before the first request,
    ``run`` once per request (from its first to its final input), ``stop`` once at shutdown.
    ``progress`` counts its engine's work (the worker reports it for liveness)."""

    def __init__(self) -> None:
        self.progress = EngineProgress()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def run(self, req: RequestContext) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    async def first_chunk_seq(self, task: StageTask, records: KeyValue | None) -> int:
        """The number of the first chunk a request sends downstream when ``task`` is the first
        input its attempt here takes (what a hold answers for a request that has not started);
        ``records``: the ``omni_requests`` bucket, where a talker notes its positions."""
        return 0

    def engine_dead(self) -> bool:
        """Whether the engine died under this live worker (it can serve nothing more)."""
        return False
