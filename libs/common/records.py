"""The per-request record in the ``omni_requests`` KV bucket (JSON, readable with ``nats kv get``)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from libs.common.envelopes import EdgeSummary

CODE_POSITIONS_KEPT = 4
"""Position notes a talker keeps per request (:attr:`StageProgress.code_positions`)."""


class RequestStatus(StrEnum):
    ADMITTED = "admitted"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.ABORTED)


class StageAttempt(BaseModel):
    """One run of a request in a stage: the first, or one after a move to another replica."""

    attempt: int
    replica: int
    bound_ns: int
    """When the request was bound to ``replica`` for this attempt."""
    reason: str | None = None
    """Why the previous attempt ended (``exit``, ``stall``, ``engine_dead``); None for the first."""
    phase: str | None = None
    """Where the previous attempt was when its replica died: ``queued`` or ``in_progress``."""
    resumed_tokens: int = 0
    """The entry stage: tokens the client already had, which this attempt went on from."""
    start_seq: int = 0
    """A later stage: the first input chunk this attempt took."""
    claimed_by: str | None = None
    """The orchestrator instance carrying out the move to this attempt; None for the first."""
    sent_ns: int | None = None
    """When the move's input was sent to ``replica``; None while the move is under way."""


class StageProgress(BaseModel):
    replica: int
    started_ns: int | None = None
    done_ns: int | None = None
    attempts: list[StageAttempt] = Field(default_factory=list)
    """Every attempt of the request in this stage, the current one last."""
    code_positions: dict[int, tuple[int, int]] = Field(default_factory=dict)
    """A talker with variable frames per segment (``orpheus``): text chunk seq -> (seq of its first
    code chunk, index of its first frame), where a talker taking the request over goes on from."""

    def note_code_position(self, text_seq: int, code_seq: int, frame: int) -> None:
        """Record where text chunk ``text_seq``'s code chunks start, dropping the oldest notes."""
        self.code_positions[text_seq] = (code_seq, frame)
        for old in sorted(self.code_positions)[:-CODE_POSITIONS_KEPT]:
            del self.code_positions[old]

    @property
    def attempt(self) -> int:
        """The current attempt (1 before any move)."""
        return self.attempts[-1].attempt if self.attempts else 1


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
    voice: str | None = None
    """``Admission.voice``, read by every attempt of the talker."""
    entry_stage: int = 0
    """``Admission.entry_stage``: the stages before it are not run (route ``-1``)."""
    arrival_ns: int
    admitted_ns: int
    deadline_ns: int
    updated_ns: int
    finish_reason: str | None = None
    error: str | None = None
    edges: list[EdgeSummary] = Field(default_factory=list)
    """Transfers into each stage (with --log-stats), as the receiving stages reported them."""
    events: list[str] = Field(default_factory=list)
    """The lifecycle events folded into this record (``<kind>.<stage>.<attempt>``), each once."""
    summary_logged: bool = False
    """The per-request summary line was written (once across orchestrators)."""
