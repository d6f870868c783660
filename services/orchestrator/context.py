"""What the orchestrator's parts (admission, lifecycle, moves) share: the connection, the pipeline,
the request records and the metrics; and the two ways they end a request from the orchestrator
(answer the client with an error, abort the request in every worker)."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from libs.common.envelopes import AbortNotice, ClientEvent, ClientEventType
from libs.common.jetstream import JetStream
from libs.common.metrics_catalog import MetricSet
from libs.common.pipeline import PipelineConfig
from libs.common.publish import publish_client
from libs.common.records import RequestRecord
from libs.common.subjects import Subjects
from services.orchestrator.routing import ReplicaPicker


@dataclass(frozen=True)
class OrchestratorContext:
    nc: NATS
    js: JetStream
    subjects: Subjects
    pipeline: PipelineConfig
    requests: KeyValue
    """The ``omni_requests`` bucket: one record per request."""
    picker: ReplicaPicker
    metrics: MetricSet

    @property
    def model(self) -> str:
        return self.pipeline.served_model_name

    def count(self, family: str, *labels: str) -> None:
        """Add one to counter ``family`` for this model and ``labels`` (when metrics are on)."""
        if self.metrics.enabled:
            self.metrics[family].labels(self.model, *labels).inc()

    async def tell_client(
        self, request_id: str, gateway_id: str, status: int, code: str, message: str
    ) -> None:
        event = ClientEvent(
            request_id=request_id, type=ClientEventType.ERROR, status=status, code=code, message=message
        )
        await publish_client(self.nc, self.subjects, gateway_id, event)

    async def end_everywhere(self, rec: RequestRecord, status: int, code: str, message: str) -> None:
        """A request this instance has just failed: abort it in every worker (reason ``code``)
        and answer the client."""
        notice = AbortNotice(request_id=rec.request_id, reason=code)
        await self.nc.publish(self.subjects.abort, notice.encode())
        await self.tell_client(rec.request_id, rec.gateway_id, status, code, message)
