"""A streamed text delta's chunk, pre-rendered per request (:class:`DeltaChunks`), is byte for
byte the chunk the schemas' pydantic models render (``model_dump_json(exclude_none=True)``, built
here from :mod:`services.gateway.schemas` directly): for any text (unicode, quotes, control
characters, empty), with and without token ids, for chat (content or an audio transcript) and
completions, and a whole stream with its finish and usage chunks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common.envelopes import ClientEvent, ClientEventType
from services.gateway.request_handle import RequestHandle
from services.gateway.responses import Collected, Job
from services.gateway.routes import (
    _chat_deltas,
    _chat_render,
    _chat_tail,
    _completion_deltas,
    _completion_render,
    _completion_tail,
)
from services.gateway.schemas import (
    AudioOut,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    Usage,
)

TEXTS = [
    "",
    "Hello",
    " world",
    '"quoted" \\ back\\slash /',
    "\n\r\t\b\f",
    "\x00\x01\x1f\x7f\x80\x9f",
    "é 中文 😀 \U0010ffff",
    "\u2028\u2029\ufeff",
    "</script><delta>",
    '"<delta>"',
]
IDS = [None, [], [0], [7, 8, 151_643], [2**31 - 1]]
NAMES = [
    ("chatcmpl-abc123", "omni-mock"),
    ('chatcmpl-"q"', 'model "x" \\ é'),
    ("chatcmpl-<delta>", "<delta>"),  # the marker in the id and model: kept
]


def job(rid: str, model: str, audio: bool = False, ids: bool = False) -> Job:
    handle = RequestHandle(rid, 0)
    kw: dict[str, Any] = {"client": None, "stats": None, "log": None}
    return Job(
        handle=handle,
        model=model,
        created=1_764_150_000,
        audio_format="wav" if audio else None,
        return_token_ids=ids,
        **kw,
    )


def chat_reference(j: Job, text: str, ids: list[int] | None) -> str:
    delta = (
        Delta(audio=AudioOut(id=f"audio-{j.id}", transcript=text)) if j.audio_format else Delta(content=text)
    )
    chunk = ChatCompletionChunk(
        id=j.id, created=j.created, model=j.model, choices=[ChunkChoice(delta=delta, token_ids=ids)]
    )
    return chunk.model_dump_json(exclude_none=True)


def completion_reference(j: Job, text: str, ids: list[int] | None) -> str:
    choice = CompletionChoice(text=text, finish_reason=None, token_ids=ids)
    return Completion(id=j.id, created=j.created, model=j.model, choices=[choice]).model_dump_json(
        exclude_none=True
    )


@pytest.mark.parametrize(("rid", "model"), NAMES)
@pytest.mark.parametrize("ids", IDS)
def test_each_delta_is_rendered_as_pydantic_renders_it(rid: str, model: str, ids: list[int] | None) -> None:
    for audio in (False, True):
        j = job(rid, model, audio=audio)
        chunks = _chat_deltas(j)
        for text in TEXTS:
            assert chunks(text, ids) == chat_reference(j, text, ids), (audio, text)
    j = job(rid, model)
    chunks = _completion_deltas(j)
    for text in TEXTS:
        assert chunks(text, ids) == completion_reference(j, text, ids), text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(),
    ids=st.none() | st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=8),
    model=st.text(min_size=1, max_size=20),
)
def test_any_text_is_rendered_as_pydantic_renders_it(text: str, ids: list[int] | None, model: str) -> None:
    chat, transcript = job("chatcmpl-h", model), job("chatcmpl-h", model, audio=True)
    completion = job("cmpl-h", model)
    assert _chat_deltas(chat)(text, ids) == chat_reference(chat, text, ids)
    assert _chat_deltas(transcript)(text, ids) == chat_reference(transcript, text, ids)
    assert _completion_deltas(completion)(text, ids) == completion_reference(completion, text, ids)


def stream_events(rid: str) -> list[ClientEvent]:
    texts = TEXTS[1:6]
    return [
        ClientEvent(request_id=rid, type=ClientEventType.STARTED),
        *[
            ClientEvent(request_id=rid, type=ClientEventType.TEXT, text=t, token_ids=[i, i + 1])
            for i, t in enumerate(texts)
        ],
    ]


@pytest.mark.parametrize("token_ids", [False, True])
def test_a_whole_chat_stream_with_its_finish_and_usage_chunks_is_pydantics(token_ids: bool) -> None:
    j = job("chatcmpl-s", "omni-mock", ids=token_ids)
    deltas, state = _chat_deltas(j), Collected()
    events = stream_events(j.id)
    got = [chunk for ev in events for chunk in _chat_render(j, deltas, ev)]
    state.finish_reason, state.usage = "length", Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    got += _chat_tail(j, state, include_usage=True)
    want = [chat_reference(j, ev.text, ev.token_ids if token_ids else None) for ev in events[1:]]
    want.append(
        ChatCompletionChunk(
            id=j.id,
            created=j.created,
            model=j.model,
            choices=[ChunkChoice(delta=Delta(), finish_reason="length")],
        ).model_dump_json(exclude_none=True)
    )
    want.append(
        ChatCompletionChunk(
            id=j.id, created=j.created, model=j.model, choices=[], usage=state.usage
        ).model_dump_json(exclude_none=True)
    )
    assert got == want


@pytest.mark.parametrize("token_ids", [False, True])
def test_a_whole_completion_stream_with_its_finish_and_usage_chunks_is_pydantics(token_ids: bool) -> None:
    j = job("cmpl-s", "omni-mock", ids=token_ids)
    deltas, state = _completion_deltas(j), Collected()
    events = stream_events(j.id)
    got = [chunk for ev in events for chunk in _completion_render(j, deltas, ev)]
    state.finish_reason, state.usage = "stop", Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    got += _completion_tail(j, state, include_usage=True)
    want = [completion_reference(j, ev.text, ev.token_ids if token_ids else None) for ev in events[1:]]
    for choices, usage in (([CompletionChoice(text="", finish_reason="stop")], None), ([], state.usage)):
        want.append(
            Completion(
                id=j.id, created=j.created, model=j.model, choices=choices, usage=usage
            ).model_dump_json(exclude_none=True)
        )
    assert got == want
