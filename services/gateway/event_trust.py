"""What the gateway takes from the bus for its requests, and what it drops as stale or forged.

The broker lets every worker publish on every gateway's ``out`` subjects (its role needs them,
whatever the request), so the gateway checks each client event itself, at the cost of a few
dictionary look-ups per event and no bus round trip or KV read (docs/security.md, "What the
application checks"):

- its subject names it: ``omni.<p>.out.<this gateway>.<request_id>`` with the event's own
  ``request_id``;
- the request is one this gateway holds;
- its stage sends that kind of event (text from the thinker or the listener, audio from the audio
  stage, an error from any stage; without a stage only an error, the orchestrator's);
- its attempt is one the gateway was told of: 1, or one the orchestrator announced with its resume
  question before the attempt started (older ones are stale: the request's fence drops them);
- its replica is a declared one and the one bound to that (stage, attempt): the replica the
  orchestrator named in its resume question, or for attempt 1 (whose route the gateway never
  hears of) the replica of the attempt's first event that passed every other check;
- an error's status is one the gateway forwards and its code a plain word (else the client gets
  502 ``bad_status``).

A worker's question about how far its attempt's events got (a ``ResumeQuery`` sent as a request on
the request's subject) passes the same checks of subject, stage, attempt and replica.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable

from libs.common.bus_trust import Rejected
from libs.common.envelopes import ClientEvent, ClientEventType, ResumeQuery
from libs.common.pipeline import PipelineConfig
from libs.common.subjects import Subjects

log = logging.getLogger(__name__)

FORWARDED_STATUSES = frozenset({400, 404, 429, 500, 502, 503, 504})
"""HTTP statuses an ``error`` event may give the client; any other is 502 ``bad_status``."""
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""An error code as omnirelay's services write them (``no_live_replica``, ``stage_error``)."""
BAD_STATUS = "bad_status"
REMEMBERED_RELEASES = 10_000
"""Request ids let go of that are remembered, so that their late events count as
``ended_request`` rather than ``unknown_request`` (about 1 MB)."""
TEXT_EVENTS = frozenset({ClientEventType.STARTED, ClientEventType.TEXT, ClientEventType.TEXT_DONE})
AUDIO_EVENTS = frozenset({ClientEventType.AUDIO, ClientEventType.AUDIO_DONE})


class Attempts:
    """What one request's client stream takes, per stage: the newest attempt announced (the
    oldest let through) and the replica bound to each (stage, attempt)."""

    def __init__(self) -> None:
        self.fence: dict[int, int] = {}
        """Stage → the newest attempt announced, which is also the oldest let through (1 when
        absent)."""
        self.replica: dict[tuple[int, int], int] = {}
        """(stage, attempt) → the replica its events come from."""

    def announced(self, stage: int) -> int:
        return self.fence.get(stage, 1)


class EventTrust:
    """The gateway's checks of what arrives for its requests; ``count`` is told of every message
    dropped (or, for ``bad_status``, changed)."""

    def __init__(self, pipeline: PipelineConfig, gateway_id: str, count: Callable[[Rejected], None]) -> None:
        self.count = count
        self._prefix = Subjects(pipeline.name).out(gateway_id, "")
        self._replicas = [s.replicas for s in pipeline.stages]
        self._max_attempt = [s.migration_limit + 1 for s in pipeline.stages]
        self._audio_stage = pipeline.audio_stage
        self._text_stages = {s for s in (pipeline.listener_stage, pipeline.thinker_stage) if s is not None}
        self._released: OrderedDict[str, None] = OrderedDict()

    # --- requests no longer held -------------------------------------------------------------
    def released(self, request_id: str) -> None:
        """The gateway let go of ``request_id`` (its stream ended, or its client went away)."""
        self._released[request_id] = None
        if len(self._released) > REMEMBERED_RELEASES:
            self._released.popitem(last=False)

    def not_held(self, request_id: str) -> Rejected:
        """Why a message for a request the gateway does not hold is dropped."""
        return Rejected.ENDED_REQUEST if request_id in self._released else Rejected.UNKNOWN_REQUEST

    def never_held(self, request_id: str) -> bool:
        return request_id not in self._released

    # --- client events -----------------------------------------------------------------------
    def subject_names(self, subject: str, request_id: str) -> bool:
        """Whether ``subject`` is ``out.<this gateway>.<request_id>``."""
        return subject.startswith(self._prefix) and subject[len(self._prefix) :] == request_id

    def origin(self, event: ClientEvent, attempts: Attempts) -> Rejected | None:
        """Why ``event`` cannot come from the attempt the request binds (None: it can). An event
        of an attempt older than the one announced passes here; the stream's fence drops it."""
        stage = event.stage
        if stage is None:
            return None if event.type == ClientEventType.ERROR else Rejected.BAD_STAGE
        if not 0 <= stage < len(self._replicas):
            return Rejected.BAD_STAGE
        if (event.type in TEXT_EVENTS and stage not in self._text_stages) or (
            event.type in AUDIO_EVENTS and stage != self._audio_stage
        ):
            return Rejected.BAD_STAGE
        if not 1 <= event.attempt <= min(attempts.announced(stage), self._max_attempt[stage]):
            return Rejected.BAD_ATTEMPT
        return self._replica(stage, event.attempt, event.replica, attempts)

    def _replica(self, stage: int, attempt: int, replica: int | None, attempts: Attempts) -> Rejected | None:
        if replica is None or not 0 <= replica < self._replicas[stage]:
            return Rejected.WRONG_REPLICA
        bound = attempts.replica.get((stage, attempt))
        if bound is None:
            return None
        return None if bound == replica else Rejected.WRONG_REPLICA

    def error_checked(self, event: ClientEvent) -> ClientEvent:
        """``event`` when it is not an error or is one the gateway forwards as it is; otherwise a
        502 ``bad_status`` with a generic message in its place (counted, the original logged)."""
        if event.type != ClientEventType.ERROR:
            return event
        if event.status in FORWARDED_STATUSES and (not event.code or ERROR_CODE.fullmatch(event.code)):
            return event
        self.count(Rejected.BAD_STATUS)
        log.warning(
            "request %s: an error event of stage %s with status %r and code %r is not forwarded as it is; "
            "the client gets 502 %s (message was %.200r)",
            event.request_id,
            event.stage,
            event.status,
            event.code[:100],
            BAD_STATUS,
            event.message,
        )
        return event.replace(
            status=502,
            code=BAD_STATUS,
            message="the pipeline answered with an error the gateway does not forward",
        )

    # --- control messages --------------------------------------------------------------------
    def resume(self, query: ResumeQuery) -> Rejected | None:
        """Why a resume question cannot be a move the pipeline may make (None: it can): a
        declared stage, a new attempt within the stage's ``migration_limit`` and, when it names
        one, a declared replica."""
        stage = query.stage
        if not 0 <= stage < len(self._replicas):
            return Rejected.BAD_STAGE
        if not 2 <= query.attempt <= self._max_attempt[stage]:
            return Rejected.BAD_ATTEMPT
        if query.replica is not None and not 0 <= query.replica < self._replicas[stage]:
            return Rejected.WRONG_REPLICA
        return None

    def question(self, query: ResumeQuery, attempts: Attempts) -> Rejected | None:
        """Why a worker's question about its attempt's events cannot come from the attempt the
        request binds (None: it can): of a stage that streams to the client, an attempt
        announced, from the replica bound to it (its subject is checked first, as an event's)."""
        stage = query.stage
        if stage not in self._text_stages and stage != self._audio_stage:
            return Rejected.BAD_STAGE
        if not 1 <= query.attempt <= min(attempts.announced(stage), self._max_attempt[stage]):
            return Rejected.BAD_ATTEMPT
        return self._replica(stage, query.attempt, query.replica, attempts)
