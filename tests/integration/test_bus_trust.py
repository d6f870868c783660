"""A bus that trusts nothing it should not, on a real nats-server: while a request streams through
the gateway's bus client, forged and stale messages published on its subjects (a wrong subject, a
claim of another replica, an unannounced attempt, a stage that sends no such event, an unknown
request, an unknown error status, insane control messages) change nothing in the client's stream,
and each moves ``vllm:omni_bus_messages_rejected_total`` under its reason exactly once; forged
registry records are neither routed to nor listed for Prometheus.

The client is wired as the gateway's app wires it (its stat logger's callbacks, the family on a
registry of the test's own). Every forged message is seen by a tap subscriber on the server before
the counters are judged, and the counters must reach their values and stay there."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest
from prometheus_client import CollectorRegistry

from libs.common.bus import services_kv
from libs.common.bus_trust import REJECTED_FAMILY, Rejected, rejection_counter
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    ResumePoint,
    ResumeQuery,
    decode,
)
from libs.common.jetstream import JetStream
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import PipelineConfig
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord
from libs.common.settings import GatewaySettings
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier
from libs.stack.processes import until
from services.gateway.discovery import sd_targets
from services.gateway.pipeline_client import PipelineClient
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.responses import error_of
from services.orchestrator.routing import ReplicaPicker
from tests.bus import text_admission

pytestmark = pytest.mark.integration

PIPELINE = PipelineConfig.model_validate(
    {
        "name": "btrust",
        "served_model_name": "btrust-model",
        "stages": [
            {"name": "thinker", "type": "llm", "model": "m", "replicas": 2, "consumes": "text", "emits": "text"},
            {"name": "talker", "type": "llm", "model": "m", "consumes": "text", "emits": "codec_codes"},
            {"name": "code2wav", "type": "codec", "model": "m", "consumes": "codec_codes", "emits": "audio"},
        ],
    }
)  # fmt: skip
SUBJECTS = Subjects(PIPELINE.name)
MODEL = PIPELINE.served_model_name
SAMPLE = f"{REJECTED_FAMILY}_total"
STALE = "vllm:omni_stale_events_dropped_total"


class Gateway:
    """The gateway's bus client as its app builds it, with its metrics on a registry of its own."""

    def __init__(self, url: str) -> None:
        self.registry = CollectorRegistry()
        stats = GatewayStatLogger(MetricSet(Exporter.GATEWAY, True, registry=self.registry), MODEL)
        settings = GatewaySettings(
            nats_url=url, instance_id=f"gw-{uuid.uuid4().hex[:6]}", advertise_host="127.0.0.1"
        )
        self.client = PipelineClient(
            settings, PIPELINE, stats.stale_event, stats.event_gap, stats.bus_rejected
        )
        self.id = settings.instance_id

    def rejected(self) -> dict[str, float]:
        """Reason → count, only the reasons that moved."""
        got = {
            r.value: self.registry.get_sample_value(SAMPLE, {"model_name": MODEL, "reason": r.value})
            for r in Rejected
        }
        assert all(v is not None for v in got.values()), "every reason's series exists from the start"
        return {r: v for r, v in got.items() if v}

    def stale(self) -> float:
        return self.registry.get_sample_value(STALE, {"model_name": MODEL, "stage": "0"}) or 0.0


@pytest.fixture
async def gateway(nats_server):
    gw = Gateway(nats_server.url)
    await gw.client.start()
    yield gw
    await gw.client.stop()


@pytest.fixture
async def bus(nats_server):
    """Two connections of the test's own: one plays the genuine senders, one the forger; and a tap
    that sees every message on the pipeline's client subjects."""
    genuine, forger, tap = [await nats.connect(nats_server.url) for _ in range(3)]
    seen: list[str] = []

    async def note(msg) -> None:
        seen.append(msg.subject)

    await tap.subscribe(f"omni.{PIPELINE.name}.out.>", cb=note)
    await barrier(tap)
    yield genuine, forger, seen
    for nc in (genuine, forger, tap):
        await nc.close()


async def counted(gateway: Gateway, want: dict[str, float], what: str) -> None:
    """Wait until the gateway's counter is ``want`` (a failure shows both)."""
    try:
        await until(lambda: gateway.rejected() == want, f"{what} counted", 5)
    except AssertionError:
        assert gateway.rejected() == want, what


async def send(nc, subject: str, rid: str, **fields) -> None:
    await nc.publish(subject, ClientEvent(request_id=rid, **fields).encode())


async def test_forged_and_stale_events_leave_the_stream_as_the_genuine_senders_sent_it(gateway, bus) -> None:
    genuine, forger, seen = bus
    adm = text_admission(gateway.id)
    handle = await gateway.client.submit(adm, {})
    rid, out = adm.request_id, SUBJECTS.out(gateway.id, adm.request_id)
    thinker = {"stage": 0, "replica": 0, "attempt": 1}
    sent: list[tuple] = []

    async def real(subject: str = out, **fields) -> None:
        await send(genuine, subject, rid, **fields)
        sent.append(
            (fields["type"], fields.get("text", ""), fields["replica"], fields["attempt"], fields["seq"])
        )

    async def forge(subject: str = out, request_id: str = rid, **fields) -> None:
        await send(forger, subject, request_id, **{**thinker, **fields})

    await real(type=ClientEventType.STARTED, **thinker, seq=0)  # binds attempt 1 to replica 0
    await barrier(genuine)
    await until(lambda: handle.first is not None, "the genuine first event is taken")
    await forge(SUBJECTS.out(gateway.id, "chatcmpl-other"), type=ClientEventType.TEXT, text="X", seq=1)
    await forge(out, "chatcmpl-other", type=ClientEventType.TEXT, text="X", seq=1)  # another's, on this one's
    await forge(type=ClientEventType.TEXT, text="X", seq=1, replica=1)  # the other thinker's claim
    await forge(type=ClientEventType.TEXT, text="X", seq=1, replica=5)  # no such replica
    await forge(type=ClientEventType.TEXT, text="X", seq=0, stage=1)  # text from the talker
    await forge(type=ClientEventType.AUDIO, pcm16=b"\1\0", seq=1)  # audio from the thinker
    await forge(type=ClientEventType.TEXT, text="X", seq=1, stage=None, replica=None)
    await forge(type=ClientEventType.TEXT, text="X", seq=0, attempt=2)  # no move announced it
    await forge(
        SUBJECTS.out(gateway.id, "chatcmpl-nobody"), "chatcmpl-nobody", type=ClientEventType.TEXT, seq=0
    )
    await real(type=ClientEventType.TEXT, text="Hel", token_ids=[5], **thinker, seq=1)
    # Control messages no move could send (orchestrators only, by the broker's permissions).
    for query in (
        ResumeQuery(request_id=rid, stage=0, attempt=9, replica=1),
        ResumeQuery(request_id="chatcmpl-nobody", stage=0, attempt=2),
    ):
        answer = await forger.request(SUBJECTS.resume(gateway.id), query.encode(), timeout=5)
        assert not decode(ResumePoint, answer.data).known
    # Questions no worker of this request's attempts could ask (workers may publish on every
    # gateway's out subjects): unanswered, and counted.
    inbox = forger.new_inbox()
    answers = await forger.subscribe(inbox)
    asked = ResumeQuery(request_id=rid, stage=0, attempt=1, replica=0)
    for subject, query in (
        (out, asked.replace(stage=1)),  # the talker streams nothing
        (out, asked.replace(replica=1)),  # not the bound replica
        (SUBJECTS.out(gateway.id, "chatcmpl-other"), asked),  # another request's subject
    ):
        await forger.publish(subject, query.encode(), reply=inbox)
    await barrier(forger)
    before_move = {
        "subject_mismatch": 3,
        "wrong_replica": 4,
        "bad_stage": 4,
        "bad_attempt": 2,
        "unknown_request": 2,
    }
    before_move["wrong_replica"] -= 1  # one of them comes after the move
    # Judged before the move: an unannounced attempt would not be one after it.
    await counted(gateway, before_move, "every forgery before the move")
    await until(lambda: handle.queue.qsize() == 2, "the genuine text is taken")
    # The orchestrator moves the thinker to replica 1 as attempt 2.
    answer = await genuine.request(
        SUBJECTS.resume(gateway.id),
        ResumeQuery(request_id=rid, stage=0, attempt=2, replica=1).encode(),
        timeout=5,
    )
    point = decode(ResumePoint, answer.data)
    assert point.known and [d.text for d in point.deltas] == ["Hel"]
    await forge(type=ClientEventType.TEXT, text="stale", seq=2)  # the old attempt: fenced off
    await forge(
        type=ClientEventType.TEXT, text="X", seq=0, attempt=2, replica=0
    )  # not the replica the move named
    await forge(type=ClientEventType.TEXT, text="X", seq=0, attempt=3, replica=1)
    await barrier(forger)
    moved = {"stage": 0, "replica": 1, "attempt": 2}
    await real(type=ClientEventType.TEXT, text="lo", token_ids=[6], **moved, seq=0)
    await real(type=ClientEventType.TEXT_DONE, finish_reason="stop", **moved, seq=1)
    await barrier(genuine)
    forged_events = 15  # every client event and question forged above, on this gateway's subjects
    await until(lambda: len(seen) >= len(sent) + forged_events, "the tap has seen every event published")
    assert len(seen) == len(sent) + forged_events

    got = []
    async for ev in handle.events():
        got.append((ev.type, ev.text, ev.replica, ev.attempt, ev.seq))
        if ev.type == ClientEventType.TEXT_DONE:
            break
    assert got == sent
    assert handle.queue.empty()
    assert answers.pending_msgs == 0, "a forged question was answered"
    expected = {**before_move, "wrong_replica": 4, "bad_attempt": 3}
    await until(lambda: gateway.rejected() == expected and gateway.stale() == 1, "every forgery counted", 5)
    # Nothing is counted twice: the genuine senders' last messages came after every forgery, on a
    # connection of their own, so give the gateway a round trip of its own and look again.
    await barrier(gateway.client.nc)
    assert gateway.rejected() == expected and gateway.stale() == 1
    gateway.client.release(rid)
    await send(forger, out, rid, type=ClientEventType.TEXT, text="late", **moved, seq=2)
    await until(lambda: gateway.rejected().get("ended_request") == 1, "the late event is counted", 5)


async def test_an_error_status_the_gateway_does_not_know_reaches_the_client_as_502(gateway, bus) -> None:
    genuine, forger, _seen = bus
    adm = text_admission(gateway.id)
    handle = await gateway.client.submit(adm, {})
    out = SUBJECTS.out(gateway.id, adm.request_id)
    await send(genuine, out, adm.request_id, type=ClientEventType.STARTED, stage=0, replica=0, seq=0)
    await barrier(genuine)
    await until(lambda: handle.first is not None, "the genuine first event is taken")
    await send(
        forger,
        out,
        adm.request_id,
        type=ClientEventType.ERROR,
        status=302,
        code="moved",
        message="see http://evil.example",
    )
    await barrier(forger)
    first = await asyncio.wait_for(handle.queue.get(), 5)
    assert first.type == ClientEventType.STARTED
    error = await asyncio.wait_for(handle.queue.get(), 5)
    api_error = error_of(error)
    assert (api_error.status, api_error.code) == (502, "bad_status")
    assert "evil" not in str(api_error.message)
    assert gateway.rejected() == {"bad_status": 1}
    gateway.client.release(adm.request_id)


async def test_forged_registry_records_are_neither_routed_to_nor_scraped(gateway, nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await services_kv(JetStream(nc))
        orch_registry = CollectorRegistry()
        counted = rejection_counter(MetricSet(Exporter.ORCHESTRATOR, True, registry=orch_registry), MODEL)
        view = LiveServices(
            kv, PIPELINE.name, config=PIPELINE, on_rejected=lambda reason, _key: counted(reason)
        )
        await view.start()
        picker = ReplicaPicker(view)

        def worker(
            stage: int, replica: int, load: int, url: str = "", name: str | None = None
        ) -> ServiceRecord:
            return ServiceRecord(
                service=ServiceKind.WORKER,
                pipeline=PIPELINE.name,
                instance=f"w{stage}{replica}",
                stage=stage,
                replica=replica,
                stage_name=name or PIPELINE.stages[stage].name,
                metrics_url=url or f"http://127.0.0.1:{9100 + 10 * stage + replica}/metrics",
                load=load,
            )

        genuine = [worker(0, 0, 3), worker(0, 1, 3), worker(2, 0, 0)]
        for rec in genuine:
            await kv.put(rec.key, rec.model_dump_json().encode())
        forged = {
            f"worker.{PIPELINE.name}.0.7": worker(0, 7, 0),  # a replica the pipeline does not declare
            f"worker.{PIPELINE.name}.1.0": worker(0, 1, 0),  # under the talker's key, claiming a thinker
            f"worker.{PIPELINE.name}.2.0": worker(2, 0, 0, url="http://scraper:secret@10.9.9.9:1/metrics"),
        }
        for key, rec in forged.items():
            await kv.put(key, rec.model_dump_json().encode())
        orch_sample = {"model_name": MODEL, "reason": "bad_record"}
        await until(
            lambda: (
                gateway.rejected().get("bad_record") == 3
                and orch_registry.get_sample_value(SAMPLE, orch_sample) == 3
            ),
            "both views have received and counted the three forged records",
        )
        await until(
            lambda: len(view.live(ServiceKind.WORKER)) == 2, "the view holds the two genuine thinkers"
        )
        assert sorted(r.key for r in view.live(ServiceKind.WORKER)) == [genuine[0].key, genuine[1].key]
        # The forgeries took their keys out of every view: the genuine code2wav record too (its
        # worker writes it again at its next heartbeat).
        assert {picker.pick(0) for _ in range(8)} == {0, 1}
        targets = [t for g in sd_targets(gateway.client.all_services.live()) for t in g["targets"]]
        assert "10.9.9.9:1" not in targets and "127.0.0.1:9107" not in targets
        assert {"127.0.0.1:9100", "127.0.0.1:9101"} <= set(targets)
        await view.stop()
        for rec in genuine:
            await kv.delete(rec.key)
        for key in forged:
            await kv.delete(key)
    finally:
        await nc.close()
