"""Malformed and hostile bus messages for the bus fuzzer (tests/e2e/test_fuzz_bus.py;
docs/testing.md, "Fuzzing").

Every subject a service of the pipeline subscribes to is a :class:`Target` with a template: a valid
envelope of the type that subject carries, for a request nobody runs. Each message sent is one
:data:`KINDS` of mutation of it, chosen by a seeded :class:`random.Random`: bytes that are not
msgpack, msgpack cut short, msgpack that is not a map, the template with fields of the wrong type,
with huge or out-of-range values, with forged attempts/stages/replicas/sequence numbers, or the
template itself (a valid envelope naming an unknown request). Subjects come from
:class:`libs.common.subjects.Subjects` only. What is not sent, and why, is in docs/testing.md.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from libs.common import headers as h
from libs.common.envelopes import ClientEvent, pack_batch
from libs.common.pipeline import Payload, PipelineConfig
from libs.common.subjects import EVENT_KINDS, Subjects, consumer_name, max_deliveries_advisory

KINDS = ("garbage", "not_msgpack", "truncated", "not_a_map", "wrong_types", "huge", "forged", "unknown_id")
"""The mutations, each equally likely."""
BIG_STRING = 64 * 1024
"""Characters of a huge string field (the message stays far below NATS's 1 MiB payload limit)."""
BIG_LIST = 20_000
"""Items of a huge list field."""
HUGE_INTS = (2**63 - 1, -(2**63), 2**64 - 1, -1, 0, 2**31)
HUGE_FLOATS = (1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324)
WRONG = (None, "x", "💥" * 3, 7, -1, 1.5, True, [], [None], {}, {"a": 1}, b"\x00\xff")
"""Values that replace a field in ``wrong_types`` (one whose type differs from the field's)."""
FORGED_FIELDS = {
    "attempt": (0, -1, 2, 99, 10**6),
    "from_attempt": (0, 99),
    "next_attempt": (0, 99),
    "stage": (-1, 9, 99),
    "replica": (-1, 9, 99),
    "seq": (-1, 1, 10**9),
    "start_seq": (-5, 10**9),
    "in_seq": (-1, 10**9),
    "route": ([], [9, 9, 9], [-1], [0, 0, 0, 0, 0, 0]),
    "entry_stage": (1, 2, 99),
    "status": (-1, 0, 200, 418, 999),
    "kind": ("start", "chunk", "finished", "nope"),
    "type": ("text", "audio", "error", "text_done", "audio_done", "started", "nope"),
}


def unknown_id(rng: random.Random) -> str:
    """A request id no gateway holds (the gateway's own ids are ``chatcmpl-``/``cmpl-``/``speech-`` + hex)."""
    return f"fuzz-{rng.getrandbits(64):016x}"


@dataclass(frozen=True)
class Target:
    """A subject a service subscribes to, and a valid envelope of what it carries."""

    subject: str
    template: Callable[[random.Random], dict[str, Any]]
    jetstream: bool = False
    """Published to JetStream (the subject is a stream's), else on core NATS."""
    headers: dict[str, str] | None = None
    reply: bool = False
    """A request/reply subject: sent with a reply inbox (the answers are counted, not judged)."""
    batch: bool = False
    """A worker's batch of client events (``out.<gateway>.~``): :func:`batch_body`."""


def _pack(value: Any) -> bytes:
    """msgpack of ``value``; a client event's map (:func:`client_event`) as the array of its values
    in field order, the shape a ClientEvent travels in."""
    if isinstance(value, dict) and value.keys() >= CLIENT_EVENT_KEYS:
        value = [value[name] for name in ClientEvent.__struct_fields__ if name in value]
    return msgpack.packb(value, use_bin_type=True)


def _wrong_type(rng: random.Random, value: Any) -> Any:
    choices = [w for w in WRONG if type(w) is not type(value)]
    return copy.deepcopy(rng.choice(choices))


def _huge(rng: random.Random, value: Any) -> Any:
    if isinstance(value, bool):
        return rng.choice(HUGE_INTS)
    if isinstance(value, int):
        return rng.choice(HUGE_INTS)
    if isinstance(value, float):
        return rng.choice(HUGE_FLOATS)
    if isinstance(value, str):
        return rng.choice(("x" * BIG_STRING, "\u0000" * 1024, "é" * BIG_STRING))
    if isinstance(value, bytes):
        return bytes(BIG_STRING * 4)
    if isinstance(value, list):
        return [rng.choice(HUGE_INTS)] * BIG_LIST
    if isinstance(value, dict):
        return {k: _huge(rng, v) for k, v in value.items()}
    return rng.choice(HUGE_INTS)


def mutate(rng: random.Random, kind: str, template: dict[str, Any]) -> bytes:
    """One message body of mutation ``kind`` of ``template`` (a valid envelope as a dict)."""
    if kind == "garbage":
        return rng.randbytes(rng.choice((0, 1, 3, 64, 1024)))
    if kind == "not_msgpack":
        return b"\xc1" + rng.randbytes(rng.randrange(0, 32))  # 0xc1 is never used in msgpack
    if kind == "truncated":
        whole = _pack(template)
        return whole[: rng.randrange(1, len(whole))]
    if kind == "not_a_map":
        return _pack(rng.choice(([1, 2, 3], 7, "request", None, True, b"\x01", 1.5, [template])))
    body = copy.deepcopy(template)
    fields = sorted(body)
    if kind == "wrong_types":
        for name in rng.sample(fields, k=min(len(fields), rng.randint(1, 3))):
            body[name] = _wrong_type(rng, body[name])
    elif kind == "huge":
        for name in rng.sample(fields, k=min(len(fields), rng.randint(1, 3))):
            body[name] = _huge(rng, body[name])
    elif kind == "forged":
        forgeable = [f for f in fields if f in FORGED_FIELDS] or fields
        for name in rng.sample(forgeable, k=min(len(forgeable), rng.randint(1, 3))):
            body[name] = copy.deepcopy(rng.choice(FORGED_FIELDS.get(name, HUGE_INTS)))
    try:
        return _pack(body)
    except (OverflowError, ValueError, TypeError):  # an int msgpack cannot hold: send the template
        return _pack(template)


def batch_body(rng: random.Random, kind: str, template: Callable[[random.Random], dict[str, Any]]) -> bytes:
    """A batch body (``envelopes.pack_batch``) of mutation ``kind``: the batch itself broken for
    the kinds that break an envelope, else one to four events, each mutated by ``kind``."""
    if kind in ("garbage", "not_msgpack"):
        return mutate(rng, kind, template(rng))
    whole = pack_batch([mutate(rng, kind, template(rng)) for _ in range(rng.randint(1, 4))])
    if kind == "truncated":
        return whole[: rng.randrange(1, len(whole))]
    if kind == "not_a_map":  # not an array of binary items
        return _pack(rng.choice(([1, 2, 3], {"a": b"x"}, [b"x", 7], "batch")))
    return whole


# --- the templates: one valid envelope per message type, for an unknown request ------------------
def _now_ns() -> int:
    return time.time_ns()


def _sampling(rng: random.Random) -> dict[str, Any]:
    return {"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "seed": rng.getrandbits(31), "stop": []}


def admission(gateway_id: str, thinker: int) -> Callable[[random.Random], dict[str, Any]]:
    """An admission at the ``thinker`` stage that, when valid, runs briefly (2 tokens, a deadline
    3 s away)."""

    def make(rng: random.Random) -> dict[str, Any]:
        now = _now_ns()
        return {
            "request_id": unknown_id(rng),
            "gateway_id": gateway_id,
            "arrival_ns": now,
            "deadline_ns": now + 3_000_000_000,
            "prompt_token_ids": [rng.randrange(3, 200) for _ in range(4)],
            "sampling": _sampling(rng),
            "audio": rng.random() < 0.5,
            "voice": None,
            "entry_stage": thinker,
            "text_chunks": [],
        }

    return make


def stage_task(
    gateway_id: str, pipeline: PipelineConfig, stage: int, replica: int
) -> Callable[[random.Random], dict]:
    """A task addressed to (``stage``, ``replica``) of the input type it consumes."""
    payload, starts = pipeline.stages[stage].consumes, pipeline.takes_start(stage)

    def make(rng: random.Random) -> dict[str, Any]:
        now = _now_ns()
        route = [0] * len(pipeline.stages)
        route[stage] = replica
        task: dict[str, Any] = {
            "request_id": unknown_id(rng),
            "gateway_id": gateway_id,
            "arrival_ns": now,
            "deadline_ns": now + 3_000_000_000,
            "route": route,
            "kind": "start" if starts else "chunk",
            "seq": 0,
            "final": rng.random() < 0.5,
            "attempt": 1,
            "from_attempt": 1,
        }
        if starts and payload == Payload.AUDIO:  # the listener's
            task["transcription"] = {"pcm16": rng.randbytes(2 * rng.choice((160, 1600)))}
        elif starts:
            task.update(prompt_token_ids=[rng.randrange(3, 200) for _ in range(4)], sampling=_sampling(rng))
        elif payload == Payload.CODEC_CODES:
            n = rng.choice((1, 25, 100))
            task["codes"] = {
                "dtype": rng.choice(("<i4", "<i8", "|O", "<U8", "V3", "nope")),
                "shape": rng.choice(([n], [n, 7], [-1], [2**40], [0])),
                "data": rng.randbytes(4 * n),
            }
        else:
            task.update(token_ids=[rng.randrange(3, 200) for _ in range(4)], text="fuzz")
        return task

    return make


CLIENT_EVENT_KEYS = {"type", "request_id", "pcm16"}
"""Keys by which :func:`_pack` tells a client event's template."""


def client_event(rng: random.Random) -> dict[str, Any]:
    return {
        "request_id": unknown_id(rng),
        "type": rng.choice(("text", "audio", "text_done", "audio_done", "error", "started")),
        "stage": rng.choice((0, 2)),
        "replica": 0,
        "seq": 0,
        "text": "injected",
        "token_ids": [5, 6],
        "pcm16": bytes(64),
        "sample_rate": 24000,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        "status": 500,
        "code": "fuzz",
        "message": "injected",
        "attempt": 1,
        "in_seq": 0,
        "frames": 1,
    }


def lifecycle(kind: str) -> Callable[[random.Random], dict[str, Any]]:
    def make(rng: random.Random) -> dict[str, Any]:
        return {
            "request_id": unknown_id(rng),
            "kind": kind,
            "ts_ns": _now_ns(),
            "stage": rng.choice((0, 1, 2)),
            "replica": 0,
            "finish_reason": "stop",
            "attempt": 1,
            "edges": [],
        }

    return make


def abort(rng: random.Random) -> dict[str, Any]:
    return {
        "request_id": unknown_id(rng),
        "reason": rng.choice(("abort", "moved", "engine_dead")),
        "stage": 0,
        "attempt": 2,
    }


def route_notice(rng: random.Random) -> dict[str, Any]:
    """A move's question that holds a request's chunks, or its moved notice that releases them."""
    common = {"request_id": unknown_id(rng), "stage": 1, "replica": 0, "attempt": 2}
    if rng.random() < 0.5:
        return {"type": "resume", **common}
    return {"type": "abort", **common, "reason": "moved", "start_seq": 0}


def resume_query(rng: random.Random) -> dict[str, Any]:
    return {"request_id": unknown_id(rng), "stage": rng.choice((0, 2)), "attempt": 2}


def question(rng: random.Random) -> dict[str, Any]:
    """A worker's question about its attempt's events (on a request's ``out`` subject)."""
    return {"request_id": unknown_id(rng), "stage": rng.choice((0, 2)), "attempt": 1, "replica": 0}


def liveness(rng: random.Random) -> dict[str, Any]:
    return {"engine_dead": False, "in_flight": 0, "busy": 0, "progress": rng.getrandbits(16)}


def targets(pipeline: PipelineConfig, gateway_ids: list[str], orchestrator_ids: list[str]) -> list[Target]:
    """Every subject a service of ``pipeline`` subscribes to (the gateways' of ``gateway_ids``, the
    orchestrators' of ``orchestrator_ids``), each with its template; the ``out`` subjects of the
    gateways are added per request by the caller (:func:`out_target`)."""
    s = Subjects(pipeline.name)
    gw = gateway_ids[0]
    out: list[Target] = [Target(s.requests, admission(gw, pipeline.thinker_stage), jetstream=True)]
    out += [Target(s.event(kind), lifecycle(kind), jetstream=True) for kind in EVENT_KINDS]
    out += [Target(s.orchestrator_alive(o), liveness, reply=True) for o in orchestrator_ids]
    for g in gateway_ids:
        out += [Target(s.resume(g), resume_query, reply=True), Target(s.out(g, "fuzz"), question, reply=True)]
        out += [Target(s.out_batch(g), client_event, batch=True)]
    out += [Target(s.abort, abort)]
    for i, stage in enumerate(pipeline.stages):
        for r in range(stage.replicas):
            addressed = {h.TO_STAGE: str(i), h.TO_REPLICA: str(r)}
            task = stage_task(gw, pipeline, i, r)
            out += [
                Target(s.stage_in(i, r), task, jetstream=True, headers=addressed),
                Target(s.stage_in(i, r), task, jetstream=True),  # no address headers
                Target(s.alive(i, r), liveness, reply=True),
                Target(s.route(i, r), route_notice, reply=True),
                Target(max_deliveries_advisory(s.stages_stream, consumer_name(i, r)), liveness),
            ]
    return out


def out_target(pipeline: PipelineConfig, gateway_id: str, request_id: str) -> Target:
    """The ``out`` subject of one request (a live one included): the events sent there name
    other, unknown requests (an event naming the live request itself is a forgery the gateway's
    message checks must refuse: issue 22 item 4, not fuzzed here)."""
    return Target(Subjects(pipeline.name).out(gateway_id, request_id), client_event)
