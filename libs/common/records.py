"""The per-request record in the ``omni_requests`` KV bucket (JSON, readable with ``nats kv get``)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from libs.common.envelopes import EdgeSummary


class RequestStatus(StrEnum):
    ADMITTED = "admitted"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.ABORTED)


class StageProgress(BaseModel):
    replica: int
    started_ns: int | None = None
    done_ns: int | None = None


class RequestRecord(BaseModel):
    """Where a request is: status, bound replica per stage, current stage, timestamps (wall ns)."""

    request_id: str
    pipeline: str
    gateway_id: str
    status: RequestStatus
    route: list[int]
    """Replica bound to each stage the request runs through (index = stage id)."""
    stages: list[StageProgress] = Field(default_factory=list)
    current_stage: int = 0
    attempt: int = 1
    trace_id: str | None = None
    arrival_ns: int
    admitted_ns: int
    deadline_ns: int
    updated_ns: int
    finish_reason: str | None = None
    error: str | None = None
    edges: list[EdgeSummary] = Field(default_factory=list)
    """Transfers into each stage (with --log-stats), as the receiving stages reported them."""
    summary_logged: bool = False
    """The per-request summary line was written (exactly once across orchestrators)."""
