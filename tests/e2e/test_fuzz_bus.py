"""The bus fuzzer (issue 22 item 7; docs/testing.md, "Fuzzing"): with live requests in flight on
the session's stack, malformed and hostile messages on every subject a service subscribes to, and
garbage in the KV buckets; every live request must complete exactly as the same seeded request
did without the fuzz, every service process must live on, ``/health`` must be ok, and nothing
the fuzz sent may leave work behind.

The session's ``nats-server`` has no identities, so the test publishes anywhere, as an attacker
who got onto the bus would. The messages come from :mod:`tests.e2e.bus_fuzz` with a seeded
:class:`random.Random` (``OMNIRELAY_FUZZ_SEED``; every failure message names the seed)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import nats
import openai
import pytest
from nats.js.errors import KeyNotFoundError

from benchmarks.process_table import descendants
from libs.common import headers as h
from libs.common.bus import evictions_kv, requests_kv, services_kv
from libs.common.pipeline import load_pipeline
from libs.common.records import RequestRecord
from libs.common.registry import ServiceRecord
from libs.common.subjects import (
    ORCHESTRATOR_ADMISSION_CONSUMER,
    ORCHESTRATOR_EVENTS_CONSUMER,
    REQUESTS_BUCKET,
    SERVICES_BUCKET,
    Subjects,
    consumer_name,
)
from tests.client_streams import bucket_keys
from tests.e2e.bus_fuzz import (
    KINDS,
    Target,
    admission,
    batch_body,
    client_event,
    mutate,
    out_target,
    stage_task,
    targets,
    unknown_id,
)
from tests.pipeline_services import openai_client

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("OMNIRELAY_FUZZ_SEED", "20261126"))
PER_TARGET = 8
"""Messages per target and round."""
MAX_ROUNDS = 6
"""Rounds sent at most while the live requests run (at least one is sent with all of them open)."""
SAMPLES_PER_CODE = 480
"""PCM samples the tiny codec makes of one code (tests/e2e/test_openai_api.py)."""
AUDIO_TOKENS = 128
TEXT_TOKENS = 160
FORGE_LIVE = True
"""Also send forged client events, resume questions and workers' questions naming the live requests, each
wrong in a way the gateway's message checks refuse (docs/security.md, "What the application
checks")."""
SETTLE_S = 45.0
"""How long the services may take to finish what the fuzz started (admissions with 3 s deadlines,
held messages), seconds."""


@dataclass(frozen=True)
class Spec:
    """One live request: streamed chat, seeded, ``ignore_eos`` so its length is fixed."""

    n: int
    audio: bool

    @property
    def max_tokens(self) -> int:
        return AUDIO_TOKENS if self.audio else TEXT_TOKENS

    def kwargs(self, model: str) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=model,
            messages=[{"role": "user", "content": f"Tell me about the sea, part {self.n}."}],
            max_tokens=self.max_tokens,
            temperature=0.8,
            seed=1000 + self.n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        if self.audio:
            kw.update(modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"})
        return kw


SPECS = [Spec(0, True), Spec(1, True), Spec(2, False), Spec(3, False)]


@dataclass
class Outcome:
    """What the client saw of one live request."""

    id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    pcm: bytearray = field(default_factory=bytearray)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    first_at: float | None = None
    done: bool = False

    def summary(self) -> str:
        return (
            f"{self.id}: {len(self.token_ids)} tokens, {len(self.pcm)} PCM bytes, finish "
            f"{self.finish_reason}, usage {self.completion_tokens}, error {self.error}"
        )


async def run(client: openai.AsyncOpenAI, spec: Spec, model: str, out: Outcome) -> None:
    try:
        stream = await client.chat.completions.create(**spec.kwargs(model))
        async for chunk in stream:
            out.id = chunk.id
            out.completion_tokens = chunk.usage.completion_tokens if chunk.usage else out.completion_tokens
            for c in chunk.choices:
                out.first_at = out.first_at or time.monotonic()
                out.token_ids += (c.model_extra or {}).get("token_ids") or []
                out.text += c.delta.content or ""
                audio = c.delta.audio
                if audio and audio.data:
                    out.pcm += base64.b64decode(audio.data)
                if audio and audio.transcript:
                    out.text += audio.transcript
                out.finish_reason = c.finish_reason or out.finish_reason
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done = True


async def run_all(base_url: str, model: str) -> tuple[list[Outcome], list[asyncio.Task[None]]]:
    client = openai_client(base_url, 180)
    outs = [Outcome() for _ in SPECS]
    tasks = [asyncio.create_task(run(client, s, model, o)) for s, o in zip(SPECS, outs, strict=True)]
    return outs, tasks


@dataclass
class Sent:
    """What the fuzzer sent: messages per kind, rounds, replies received, publish errors."""

    by_kind: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    replies: int = 0
    refused: list[str] = field(default_factory=list)
    """JetStream publishes the server refused (not a failure: it judged the message itself)."""

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


async def send_round(
    nc: Any, js: Any, rng: random.Random, fuzz_targets: list[Target], inbox: str, sent: Sent
) -> None:
    """:data:`PER_TARGET` messages of random kinds to every target."""
    for t in fuzz_targets:
        for _ in range(PER_TARGET):
            kind = rng.choice(KINDS)
            body = batch_body(rng, kind, t.template) if t.batch else mutate(rng, kind, t.template(rng))
            sent.by_kind[kind] = sent.by_kind.get(kind, 0) + 1
            if t.jetstream:
                headers = {**(t.headers or {}), "Nats-Msg-Id": f"fuzz-{rng.getrandbits(64):x}"}
                try:
                    await js.publish(t.subject, body, headers=headers, timeout=10)
                except Exception as e:  # the server may refuse a message (too large, ...)
                    sent.refused.append(f"{t.subject} {kind}: {type(e).__name__}: {e}")
            else:
                await nc.publish(t.subject, body, reply=inbox if t.reply else "", headers=t.headers)
    await nc.flush(timeout=30)
    sent.rounds += 1


async def live_id_messages(
    js: Any, pipeline: Any, gateway_id: str, rng: random.Random, live: list[str]
) -> int:
    """Messages naming the live requests that the services must shrug off: a duplicate admission
    (the record exists: harmless). Not sent: an abort, a route hold, a resume query, lifecycle
    events or client events naming a live request, which the protocol honours by design from any
    sender the bus's identities let through (docs/security.md, the bus)."""
    s = Subjects(pipeline.name)
    for rid in live:
        again = {**admission(gateway_id, pipeline.thinker_stage)(rng), "request_id": rid}
        await js.publish(s.requests, msgpack.packb(again), timeout=10)  # no Nats-Msg-Id: not deduplicated
    return len(live)


def forged_live(
    pipeline: Any, gateway_id: str, rng: random.Random, live: list[str]
) -> list[tuple[str, bytes, bool]]:
    """(subject, body, sent as a request) of messages naming the live requests that the gateway
    must drop: client events of a stage that does not send their kind, of an attempt never
    announced, of a replica the pipeline does not declare, or on another request's subject; resume
    questions of an attempt never announced or a replica not declared; workers' questions of a
    stage that streams nothing to the client, an attempt never announced or a replica not bound.
    (A stage-less error or an event of the bound replica are accepted by design: "What is still
    open" there.)"""
    s = Subjects(pipeline.name)
    audio_stage, thinker, talker = pipeline.audio_stage, pipeline.thinker_stage, pipeline.speech_stage
    out = []
    for i, rid in enumerate(live):
        other = live[(i + 1) % len(live)]
        base = {**client_event(rng), "request_id": rid, "seq": 1, "replica": 0, "attempt": 1}
        events = [
            {**base, "type": "text", "stage": audio_stage},  # text from the audio stage
            {**base, "type": "audio", "stage": thinker},  # audio from the thinker
            {**base, "type": "text", "stage": thinker, "attempt": 99},  # an attempt never announced
            {**base, "type": "text_done", "stage": thinker, "replica": 9},  # a replica not declared
            {**base, "type": "audio_done", "stage": audio_stage, "replica": 9},
        ]
        out += [(s.out(gateway_id, rid), msgpack.packb(e), False) for e in events]
        out.append(
            (s.out(gateway_id, other), msgpack.packb({**base, "stage": thinker, "type": "text_done"}), False)
        )
        for query in ({"stage": thinker, "attempt": 99}, {"stage": thinker, "attempt": 2, "replica": 9}):
            out.append((s.resume(gateway_id), msgpack.packb({"request_id": rid, **query}), True))
        for query in ({"stage": talker}, {"attempt": 99}, {"replica": 9}):
            asked = {"request_id": rid, "stage": thinker, "attempt": 1, "replica": 0, **query}
            out.append((s.out(gateway_id, rid), msgpack.packb(asked), True))
    return out


THINKER = load_pipeline().thinker_stage
FORGED_RECORD = {
    "service": "worker",
    "instance": "forged",
    "stage": THINKER,
    "stage_name": "thinker",
    "replica": 5,
    "metrics_url": "http://127.0.0.1:1/metrics",
    "load": 0,
}
"""A well-formed registry record of a thinker replica the pipeline does not declare, with no load:
it would attract prompts to a subject nobody consumes if routing took it."""


async def garbage_record_inputs(
    nc: Any, js: Any, pipeline: Any, gateway_id: str, rng: random.Random, ids: list[str]
) -> int:
    """For each request whose record is garbage: a first input of the talker, addressed and bound
    to it (the worker reads the record before it starts a request)."""
    s = Subjects(pipeline.name)
    talker = pipeline.speech_stage
    for rid in ids:
        task = {**stage_task(gateway_id, pipeline, talker, 0)(rng), "request_id": rid}
        headers = {h.TO_STAGE: str(talker), h.TO_REPLICA: "0", "Nats-Msg-Id": f"fuzz-{rid}"}
        await js.publish(s.stage_in(talker, 0), msgpack.packb(task), headers=headers, timeout=10)
    return len(ids)


async def kv_garbage(js: Any, rng: random.Random, pipeline: str) -> list[tuple[Any, str]]:
    """Garbage records under valid keys no live service or request uses (a live service's own key
    is rewritten by its heartbeat every 2 s; a live request's record is its state): records that do
    not parse, wrong-typed JSON, a replica the pipeline does not declare; a request record that is
    garbage under an id the fuzz then sends stage inputs for. Returns (bucket, key) to
    delete afterwards."""
    services, requests, evictions = await services_kv(js), await requests_kv(js), await evictions_kv(js)
    written = []
    for key, value in [
        (f"worker.{pipeline}.0.7", rng.randbytes(40)),
        (f"worker.{pipeline}.1.9", b'{"service": 7, "load": "many"}'),
        (f"gateway.{pipeline}.fuzz{rng.getrandbits(32):x}", b"\xc1not json"),
        (f"orchestrator.{pipeline}.fuzz{rng.getrandbits(32):x}", b"[]"),
        (f"worker.{pipeline}.0.8", b"{" * 5000),
        (f"worker.{pipeline}.{THINKER}.5", json.dumps(FORGED_RECORD | {"pipeline": pipeline}).encode()),
    ]:
        await services.put(key, value)
        written.append((services, key))
    for value in (rng.randbytes(64), b'{"request_id": 5}', b"null"):
        key = unknown_id(rng)
        await requests.put(key, value)
        written.append((requests, key))
    key = f"{pipeline}.0.0.{rng.getrandbits(40)}"
    await evictions.put(key, rng.randbytes(16))
    written.append((evictions, key))
    return written


def service_pids(root: int) -> dict[int, str]:
    """Every process under ``omnirelay up``: the services and their engines (pid → command line)."""
    out = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            out[pid] = " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:6])
    return out


async def registry(nc: Any, pipeline: str) -> tuple[list[str], list[str], dict[str, int]]:
    """Gateway and orchestrator instance ids of ``pipeline``, and every service's load."""
    kv = await services_kv(nc.jetstream())
    gateways, orchestrators, loads = [], [], {}
    for key in await bucket_keys(nc, SERVICES_BUCKET):
        with contextlib.suppress(KeyNotFoundError, ValueError):
            rec = ServiceRecord.model_validate_json((await kv.get(key)).value)
            if rec.pipeline != pipeline:
                continue
            loads[key] = rec.load
            if rec.service == "gateway":
                gateways.append(rec.instance)
            elif rec.service == "orchestrator":
                orchestrators.append(rec.instance)
    return gateways, orchestrators, loads


async def held_messages(js: Any, pipeline: Any) -> dict[str, int]:
    """Messages each durable consumer of the pipeline has delivered and not had acknowledged or
    terminated (a message its service failed on and left to be delivered again), by consumer."""
    s = Subjects(pipeline.name)
    consumers = [
        (s.requests_stream, ORCHESTRATOR_ADMISSION_CONSUMER),
        (s.events_stream, ORCHESTRATOR_EVENTS_CONSUMER),
    ] + [
        (s.stages_stream, consumer_name(i, r))
        for i, st in enumerate(pipeline.stages)
        for r in range(st.replicas)
    ]
    out = {}
    for stream, name in consumers:
        info = await js.consumer_info(stream, name)
        out[name] = info.num_ack_pending
    return out


async def open_records(nc: Any, pipeline: str) -> set[str]:
    """Request records of ``pipeline`` that have not ended (garbage ones skipped)."""
    kv = await requests_kv(nc.jetstream())
    out = set()
    for key in await bucket_keys(nc, REQUESTS_BUCKET):
        with contextlib.suppress(KeyNotFoundError, ValueError):
            rec = RequestRecord.model_validate_json((await kv.get(key)).value)
            if rec.pipeline == pipeline and not rec.status.terminal:
                out.add(key)
    return out


def judge(spec: Spec, got: Outcome, want: Outcome, pipeline: Any) -> list[str]:
    """What is wrong with ``got`` against the fault-free ``want`` of the same request."""
    bad = []
    if got.error or not got.done:
        bad.append(f"ended with {got.error or 'nothing'}")
    if got.finish_reason not in ("length", "stop") or got.completion_tokens != spec.max_tokens:
        bad.append(f"finish {got.finish_reason}, {got.completion_tokens} tokens of {spec.max_tokens}")
    if got.token_ids != want.token_ids:
        bad.append(f"token ids differ from the fault-free run: {got.token_ids[:20]} vs {want.token_ids[:20]}")
    if got.text != want.text:
        bad.append(f"text differs from the fault-free run: {got.text[:80]!r} vs {want.text[:80]!r}")
    if spec.audio:
        samples = spec.max_tokens * pipeline.stages[pipeline.speech_stage].codes_per_token * SAMPLES_PER_CODE
        if len(got.pcm) != 2 * samples:
            bad.append(f"{len(got.pcm)} PCM bytes, {2 * samples} expected")
        if got.pcm != want.pcm:
            bad.append("audio differs from the fault-free run")
    return [f"request {spec.n} ({'audio' if spec.audio else 'text'}) {got.id}: {b}" for b in bad]


async def test_bus_fuzz_leaves_live_requests_unharmed(stack, pipeline) -> None:
    rng = random.Random(SEED)
    model = pipeline.served_model_name
    where = f"(seed {SEED}: OMNIRELAY_FUZZ_SEED={SEED} reproduces it)"
    # The fault-free run of the same seeded requests, side by side as under the fuzz.
    clean, tasks = await run_all(stack.base_url, model)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    assert all(
        o.error is None and o.completion_tokens == s.max_tokens for s, o in zip(SPECS, clean, strict=True)
    ), [o.summary() for o in clean]
    nc = await nats.connect(stack.nats_url, name="bus-fuzzer")
    garbage: list[tuple[Any, str]] = []
    try:
        js = nc.jetstream()
        gateways, orchestrators, _ = await registry(nc, pipeline.name)
        assert gateways and orchestrators, (gateways, orchestrators)
        pids = service_pids(stack.proc.pid)
        assert len(pids) >= 2 + sum(s.replicas for s in pipeline.stages), pids
        open_before = await open_records(nc, pipeline.name)
        inbox = nc.new_inbox()
        sent = Sent()

        async def on_reply(_msg: Any) -> None:
            sent.replies += 1

        await nc.subscribe(inbox, cb=on_reply)
        base_targets = targets(pipeline, gateways, orchestrators)
        # The live requests; the fuzz starts once each has its first chunk (all stages busy).
        live, tasks = await run_all(stack.base_url, model)
        deadline = time.monotonic() + 120
        while not all(o.first_at and o.id for o in live):
            assert not any(o.done for o in live), [o.summary() for o in live]
            assert time.monotonic() < deadline, "the live requests did not start"
            await asyncio.sleep(0.02)
        live_ids = [o.id for o in live]
        garbage = await kv_garbage(js, rng, pipeline.name)
        bad_records = [key for bucket, key in garbage if key.startswith("fuzz-")]
        live_msgs = await garbage_record_inputs(nc, js, pipeline, gateways[0], rng, bad_records)
        outs = [out_target(pipeline, g, rid) for g in gateways for rid in [*live_ids, unknown_id(rng)]]
        fuzz_targets = base_targets + outs
        open_after_first: list[bool] = []
        live_msgs += await live_id_messages(js, pipeline, gateways[0], rng, live_ids)
        forged = forged_live(pipeline, gateways[0], rng, live_ids) if FORGE_LIVE else []
        # Rounds while the live requests run: the first one with every request open.
        while sent.rounds < MAX_ROUNDS and (sent.rounds == 0 or not all(o.done for o in live)):
            await send_round(nc, js, rng, fuzz_targets, inbox, sent)
            for subject, body, asks in forged:
                await nc.publish(subject, body, reply=inbox if asks else "")
            if sent.rounds == 1:
                open_after_first = [not o.done for o in live]
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        summary = (
            f"{sent.total} messages in {sent.rounds} rounds to {len(fuzz_targets)} subjects "
            f"({sent.by_kind}), {live_msgs} naming live requests or garbage records, {len(forged)} forged per round, {len(garbage)} garbage KV records, "
            f"{sent.replies} replies, {len(sent.refused)} refused by JetStream; open after the first "
            f"round: {open_after_first} {where}"
        )
        print(summary)
        assert any(open_after_first[i] for i, s in enumerate(SPECS) if s.audio), (
            f"no audio request was still open after the first round: the fuzz did not meet them in flight; {summary}"
        )
        bad = [b for s, g, w in zip(SPECS, live, clean, strict=True) for b in judge(s, g, w, pipeline)]
        assert not bad, "\n".join(bad) + f"\n{summary}"
        # Every service process lives on, the stack is healthy, and nothing the fuzz started stays.
        gone = {pid: cmd for pid, cmd in pids.items() if not os.path.exists(f"/proc/{pid}")}
        assert not gone, f"service processes died: {gone}; {summary}"
        for bucket, key in garbage:
            with contextlib.suppress(Exception):
                await bucket.purge(key)
        garbage = []
        deadline = time.monotonic() + SETTLE_S
        while True:
            _, _, loads = await registry(nc, pipeline.name)
            still = await open_records(nc, pipeline.name) - open_before
            held = await held_messages(js, pipeline)
            health = httpx.get(f"{stack.base_url}/health", timeout=10)
            if (
                not any(loads.values())
                and not still
                and not any(held.values())
                and health.json().get("status") == "ok"
            ):
                break
            assert time.monotonic() < deadline, (
                f"after the fuzz: loads {loads}, records not ended {sorted(still)[:5]}, messages held "
                f"unacknowledged {held}, health {health.status_code} {health.text}; {summary}"
            )
            await asyncio.sleep(0.5)
        gone = {pid: cmd for pid, cmd in pids.items() if not os.path.exists(f"/proc/{pid}")}
        assert not gone, f"service processes died after the fuzz: {gone}; {summary}"
    finally:
        for bucket, key in garbage:
            with contextlib.suppress(Exception):
                await bucket.purge(key)
        await nc.close()
