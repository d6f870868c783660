"""A real code2wav stage worker on a real nats-server, fed by hand: ordering, duplicates, bad
input, aborts, deadlines and malformed messages. The test plays the talker and the gateway."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from libs.common import headers as h
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    NdArray,
    StageTask,
    TaskKind,
)
from libs.common.publish import Hop, publish_task
from libs.common.settings import WorkerSettings
from libs.common.subjects import Subjects, consumer_name
from libs.models.tiny import resolve_model
from tests import procs
from tests.bus import abort, collect, holds_nothing, in_flight
from tests.metrics_scrape import delta, scrape, total
from tests.pipeline_services import Services
from tests.procs import CODE2WAV_YAML, TALKER_YAML, THINKER_YAML, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "c2wtest"
GATEWAY = "gw2"
SUBJECTS = Subjects(PIPELINE)
HOP = Hop("1", "0", 2, 0)


@pytest.fixture(scope="module")
def worker(nats_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("c2w")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    services = Services(nats_server.url, path, tmp).start(orchestrators=0, gateway=False, workers=[(2, 0)])
    proc = services.wait_ready().worker(2)
    yield proc
    assert proc.stop() == 0  # SIGTERM: drained and exited cleanly


SAMPLE_RATE, SAMPLES_PER_CODE = 24_000, 480
"""docs/contract.md, "Pipelines and stages": PCM16 mono at 24 kHz, a 50 Hz codec (480 samples per code)."""


@cache
def _codec_weights() -> tuple[dict, dict[str, np.ndarray]]:
    model = Path(resolve_model("tiny-code2wav"))
    cfg = json.loads((model / "config.json").read_text())
    weights = load_file(str(model / "model.safetensors"))
    return cfg, {k: v.astype(np.float64) for k, v in weights.items()}


def reference_pcm16(codes: list[int]) -> np.ndarray:
    """The tiny code2wav decoder run in the test, in float64 numpy from the model's weight file
    (not through ``libs.models.codec``): embedding, two transposed convolutions whose stride is
    their kernel (so each frame maps to its own output steps) with an exact GELU between, then
    ``0.5 * tanh(gain * x)``, rounded to int16 samples."""
    cfg, w = _codec_weights()
    assert (cfg["sample_rate"], cfg["samples_per_code"]) == (SAMPLE_RATE, SAMPLES_PER_CODE)
    x = w["embed.weight"][np.asarray(codes, dtype=np.int64)]  # [codes, embed]
    coarse = np.einsum("te,eok->tko", x, w["coarse.weight"]) + w["coarse.bias"]  # [codes, steps, hidden]
    gelu = 0.5 * coarse * (1.0 + np.vectorize(math.erf)(coarse / math.sqrt(2.0)))
    fine = np.einsum("tkh,hm->tkm", gelu, w["fine.weight"][:, 0, :]) + w["fine.bias"][0]
    wave = 0.5 * np.tanh(float(w["gain"]) * fine.reshape(-1))
    return np.round(np.clip(wave, -1.0, 1.0) * 32767.0).astype(np.int16)


def assert_audio_of(pcm16: bytes, codes: list[int]) -> None:
    """``pcm16`` (little-endian int16 mono, as received) is the audio of ``codes``: one code's
    worth of samples per code, audible, and within 1 LSB (float32 against float64 rounding) of
    the reference decode."""
    assert len(pcm16) == 2 * SAMPLES_PER_CODE * len(codes), (len(pcm16), len(codes))
    got = np.frombuffer(pcm16, dtype="<i2").astype(np.int32)
    want = reference_pcm16(codes).astype(np.int32)
    assert np.sqrt(np.mean(want.astype(np.float64) ** 2)) > 1000, "the reference itself is silent"
    worst = int(np.max(np.abs(got - want)))
    assert worst <= 1, f"decoded audio differs from the reference by up to {worst} LSB"


def chunk(rid: str, seq: int, codes: list[int], final: bool = False, deadline_s: float = 30.0) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=rid,
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + int(deadline_s * 1e9),
        route=[0, 0, 0],
        kind=TaskKind.CHUNK,
        seq=seq,
        final=final,
        codes=NdArray.of(np.asarray(codes, dtype=np.int32)),
    )


async def events_of(nc, rid: str) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(q, ClientEvent))
    return q


async def until(q: asyncio.Queue, kind: ClientEventType, timeout_s: float = 10.0) -> list[ClientEvent]:
    got = []
    while True:
        ev = await asyncio.wait_for(q.get(), timeout_s)
        got.append(ev)
        if ev.type in (kind, ClientEventType.ERROR):
            return got


async def consumer_drained(js, timeout_s: float = 10.0) -> None:
    """Wait until code2wav's consumer holds nothing: every message delivered and acknowledged."""

    async def drained() -> bool:
        info = await js.consumer_info(SUBJECTS.stages_stream, consumer_name(2, 0))
        return info.num_ack_pending == 0 and info.num_pending == 0

    await procs.until(drained, "code2wav's consumer drained", timeout_s, every_s=0.05)


async def test_chunks_are_decoded_in_sequence_order_and_duplicates_dropped(worker, nc) -> None:
    rid = f"order-{time.time_ns()}"
    q = await events_of(nc, rid)
    js = nc.jetstream()
    parts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    before = scrape(worker.metrics_url)
    # seq 2 (final) first, then 1, then 0, then 1 again: the worker must hold and reorder; the
    # re-sent seq 1 carries the same Nats-Msg-Id and JetStream drops it as a duplicate.
    sent, duplicates = [], []
    for seq in (2, 1, 0, 1):
        task = chunk(rid, seq, parts[seq], final=seq == 2)
        ack = await publish_task(js, SUBJECTS, task, HOP)
        (duplicates if ack.duplicate else sent).append(len(task.encode()))
    assert len(duplicates) == 1
    evs = await until(q, ClientEventType.AUDIO_DONE)
    after = scrape(worker.metrics_url)
    edge = dict(from_stage="1", from_replica="0", to_stage="2", to_replica="0")
    # Every transfer is observed once, with the bytes that were sent.
    assert delta(before, after, "vllm:omni_transfer_size_bytes_count", **edge) == 3
    assert delta(before, after, "vllm:omni_transfer_size_bytes_sum", **edge) == sum(sent)
    assert delta(before, after, "vllm:omni_transfer_in_flight_s_count", **edge) == 3
    audio = [e for e in evs if e.type == ClientEventType.AUDIO]
    assert [e.seq for e in evs] == list(range(len(evs)))
    assert [e.in_seq for e in audio] == [0, 1, 2]  # in sequence order, the duplicate not decoded
    for e in audio:
        assert_audio_of(e.pcm16, parts[e.in_seq])
    assert all(e.sample_rate == SAMPLE_RATE and (e.stage, e.replica) == (2, 0) for e in evs)
    # Nothing is left un-acked once the request is done (the duplicate included).
    await consumer_drained(js)


async def test_the_decoding_thread_yields_to_the_control_plane(worker, nc) -> None:
    """The thread that decodes (started by the worker's first chunk) runs at the engine's nice
    value, the worker's event loop and every other thread at 0 (docs/reliability.md, "The
    engines yield the CPU"). Python does not name its threads for the kernel: the decoding
    thread is the one at the engine's nice value, and there must be one."""
    rid = f"nice-{time.time_ns()}"
    q = await events_of(nc, rid)
    await publish_task(nc.jetstream(), SUBJECTS, chunk(rid, 0, [1, 2], final=True), HOP)
    await until(q, ClientEventType.AUDIO_DONE)
    threads = [int(t.name) for t in Path(f"/proc/{worker.proc.pid}/task").iterdir()]
    nices = [os.getpriority(os.PRIO_PROCESS, t) for t in threads]
    engine_nice = WorkerSettings().engine_nice
    assert engine_nice > 0 and sorted(set(nices)) == [0, engine_nice], nices
    assert nices.count(engine_nice) == 1, nices  # one decoding thread (its pool has one)
    assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == 0


async def test_out_of_range_codes_fail_the_request_with_a_named_error(worker, nc) -> None:
    rid = f"bad-{time.time_ns()}"
    q = await events_of(nc, rid)
    await publish_task(nc.jetstream(), SUBJECTS, chunk(rid, 0, [5, 4096], final=True), HOP)
    ev = (await until(q, ClientEventType.AUDIO_DONE))[-1]
    assert (ev.type, ev.status, ev.code) == (ClientEventType.ERROR, 500, "codec_input_rejected")
    assert "4096" in ev.message


async def test_abort_notice_stops_a_waiting_request_and_late_chunks_are_dropped(worker, nc) -> None:
    rid = f"abort-{time.time_ns()}"
    q = await events_of(nc, rid)
    js = nc.jetstream()
    await publish_task(js, SUBJECTS, chunk(rid, 0, [1, 2]), HOP)
    assert (await asyncio.wait_for(q.get(), 10)).type == ClientEventType.AUDIO
    assert await in_flight(nc, SUBJECTS, 2, 0) == 1, "the request does not wait for its last chunk"
    await abort(nc, SUBJECTS, rid)
    await procs.until(
        lambda: holds_nothing(nc, SUBJECTS, 2, 0), "the worker stopped the request", timeout_s=10
    )
    await publish_task(js, SUBJECTS, chunk(rid, 1, [3], final=True), HOP)
    # The late chunk is taken and acknowledged (dropped), and nothing reaches the client.
    await consumer_drained(js)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(q.get(), 1.5)


async def test_a_request_waiting_past_its_deadline_gets_a_504(worker, nc) -> None:
    rid = f"late-{time.time_ns()}"
    q = await events_of(nc, rid)
    # seq 1 arrives, seq 0 never does: the request cannot progress and must not hang.
    await publish_task(nc.jetstream(), SUBJECTS, chunk(rid, 1, [1], final=True, deadline_s=1.0), HOP)
    ev = await asyncio.wait_for(q.get(), 5)
    assert (ev.type, ev.status, ev.code) == (ClientEventType.ERROR, 504, "timeout")


async def test_held_messages_show_as_ack_pending_in_the_consumer_state(worker, nc) -> None:
    rid = f"held-{time.time_ns()}"
    q = await events_of(nc, rid)
    js = nc.jetstream()
    for seq in (1, 2):  # seq 0 missing: both wait, un-acked, in the worker
        await publish_task(js, SUBJECTS, chunk(rid, seq, [1], final=seq == 2), HOP)
    await _wait_metric(worker.metrics_url, "vllm:omni_bus_consumer_ack_pending", 2)
    await publish_task(js, SUBJECTS, chunk(rid, 0, [1]), HOP)
    await until(q, ClientEventType.AUDIO_DONE)
    await _wait_metric(worker.metrics_url, "vllm:omni_bus_consumer_ack_pending", 0)


async def _wait_metric(url: str, name: str, value: float, timeout_s: float = 10.0) -> None:
    async def shown() -> bool:
        return total(await asyncio.to_thread(scrape, url), name) == value

    await procs.until(shown, f"{name} at {value}", timeout_s, every_s=0.25)


async def test_malformed_and_misaddressed_messages_are_terminated(worker, nc) -> None:
    before = scrape(worker.metrics_url)
    js = nc.jetstream()
    subject = SUBJECTS.stage_in(2, 0)
    await js.publish(subject, b"\xc1", headers={h.TO_STAGE: "2", h.TO_REPLICA: "0"})
    misrouted = chunk("x", 0, [1], final=True)
    await js.publish(subject, misrouted.encode(), headers={h.TO_STAGE: "1", h.TO_REPLICA: "0"})

    def terminated(reason: str) -> float:
        return delta(
            before, scrape(worker.metrics_url), "vllm:omni_bus_messages_terminated_total", reason=reason
        )

    await procs.until(lambda: terminated("not_msgpack") and terminated("misaddressed"), "both terminated")
    assert terminated("not_msgpack") == terminated("misaddressed") == 1
    await consumer_drained(js)  # terminated: neither is delivered again
    # ... and the worker keeps serving.
    await test_chunks_are_decoded_in_sequence_order_and_duplicates_dropped(worker, nc)


async def test_a_sender_clock_ahead_is_clamped_and_counted(worker, nc) -> None:
    """A chunk whose sender stamped its hand-off 5 s in the future (its clock runs ahead): the
    receiver's cross-clock intervals (Tx-End → receipt, Tx-End → stored) come out negative, are
    observed as 0 and counted as clamps; the sender's own interval (tx) and the broker's (queue
    wait) are not."""
    before = scrape(worker.metrics_url)
    rid = f"skew-{time.time_ns()}"
    q = await events_of(nc, rid)
    task = chunk(rid, 0, [1, 2], final=True)
    ahead = time.time_ns() + 5 * 10**9
    headers = {
        h.REQUEST_ID: rid,
        h.FROM_STAGE: HOP.from_stage,
        h.FROM_REPLICA: HOP.from_replica,
        h.TO_STAGE: str(HOP.to_stage),
        h.TO_REPLICA: str(HOP.to_replica),
        h.SEQ: "0",
        h.FINAL: "true",
        h.TX_START_NS: str(ahead),
        h.TX_END_NS: str(ahead + 1000),
    }
    await nc.jetstream().publish(SUBJECTS.stage_in(2, 0), task.encode(), headers=headers)
    await until(q, ClientEventType.AUDIO_DONE)
    after = scrape(worker.metrics_url)
    edge = dict(from_stage="1", from_replica="0", to_stage="2", to_replica="0")
    clamps = {
        i: delta(before, after, "vllm:omni_transfer_clock_skew_clamps_total", interval=i, **edge)
        for i in ("tx", "in_flight", "publish", "queue_wait")
    }
    assert clamps == {"tx": 0, "in_flight": 1, "publish": 1, "queue_wait": 0}
    assert delta(before, after, "vllm:omni_transfer_in_flight_s_count", **edge) == 1
    assert delta(before, after, "vllm:omni_transfer_in_flight_s_sum", **edge) == 0
    assert delta(before, after, "vllm:omni_transfer_tx_s_sum", **edge) == pytest.approx(1e-6)
