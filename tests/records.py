"""Request records as the orchestrator's admission writes them, for tests that play it."""

from __future__ import annotations

import time

from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress


def bound_record(
    request_id: str,
    route: list[int],
    *,
    pipeline: str = "p",
    gateway_id: str = "g",
    status: RequestStatus = RequestStatus.ADMITTED,
    deadline_s: float = 60.0,
) -> RequestRecord:
    """A record whose every stage is bound to its ``route`` replica at attempt 1, now (wall
    clock), with its deadline ``deadline_s`` seconds away."""
    now = time.time_ns()
    return RequestRecord(
        request_id=request_id,
        pipeline=pipeline,
        gateway_id=gateway_id,
        status=status,
        route=route,
        stages=[
            StageProgress(replica=r, attempts=[StageAttempt(attempt=1, replica=r, bound_ns=now)])
            for r in route
        ],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + int(deadline_s * 1e9),
        updated_ns=now,
    )
