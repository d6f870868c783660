"""``seed``, ``top_p``, ``stop`` and ``max_completion_tokens`` through the whole stack, with the
official ``openai`` client: each changes what comes back the way OpenAI's API defines it.

The ground truth is the engine's own greedy answer to the same prompt (``temperature: 0``,
``ignore_eos``: a fixed number of tokens), taken once per module and shown to be reproducible;
every other request is judged against it or against another request, never against a stored
value. Token ids come from the ``return_token_ids`` extension (docs/api.md)."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from openai.types.chat import ChatCompletion

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me a long story about the kettle and the weather."}]
N = 24
"""Tokens of the greedy reference (every request here generates at most this many)."""


@dataclass(frozen=True)
class Answer:
    text: str
    ids: list[int]
    finish_reason: str
    completion_tokens: int


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, pipeline, **params) -> Answer:
    """A non-streamed chat answer to :data:`MESSAGES` (``ignore_eos`` unless given)."""
    extra = {"ignore_eos": True, "return_token_ids": True, **params.pop("extra_body", {})}
    params.setdefault("max_tokens", N)
    r: ChatCompletion = client.chat.completions.create(
        model=pipeline.served_model_name, messages=MESSAGES, extra_body=extra, **params
    )
    choice = r.choices[0]
    assert r.usage is not None
    return Answer(
        choice.message.content or "",
        list(choice.model_extra["token_ids"]),
        choice.finish_reason,
        r.usage.completion_tokens,
    )


@pytest.fixture(scope="module")
def greedy(client, pipeline) -> Answer:
    """The greedy reference: the same answer twice (so comparing with it means something)."""
    first = chat(client, pipeline, temperature=0)
    again = chat(client, pipeline, temperature=0)
    assert first == again, "greedy decoding is not reproducible on this stack"
    assert (first.finish_reason, first.completion_tokens, len(first.ids)) == ("length", N, N)
    return first


def test_the_same_seed_gives_the_same_tokens_and_another_seed_other_tokens(client, pipeline, greedy) -> None:
    a = chat(client, pipeline, temperature=1.0, seed=1234)
    b = chat(client, pipeline, temperature=1.0, seed=1234)
    c = chat(client, pipeline, temperature=1.0, seed=4321)
    assert len(a.ids) == len(c.ids) == N
    assert a.ids == b.ids and a.text == b.text
    assert a.ids != c.ids
    assert a.ids != greedy.ids and c.ids != greedy.ids, "temperature 1 sampled the greedy tokens"


def test_a_tiny_top_p_samples_the_greedy_tokens(client, pipeline, greedy) -> None:
    """``top_p`` keeps the smallest set of most likely tokens whose mass reaches it: almost
    nothing keeps only the most likely token, at any temperature and seed. The same seed with
    ``top_p: 1`` samples other tokens, so the difference is ``top_p``'s."""
    narrow = chat(client, pipeline, temperature=1.0, top_p=1e-6, seed=99)
    wide = chat(client, pipeline, temperature=1.0, top_p=1.0, seed=99)
    assert narrow.ids == greedy.ids and narrow.text == greedy.text
    assert wide.ids != greedy.ids


def stop_string(text: str) -> str:
    """A piece of ``text`` from its middle that has visible characters (the stop string)."""
    mid = len(text) // 2
    for start in range(mid, len(text) - 3):
        piece = text[start : start + 3]
        if piece.strip() and text.index(piece) > 0:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_ends_the_text_before_the_stop_string(client, pipeline, greedy) -> None:
    stop = stop_string(greedy.text)
    expected = greedy.text[: greedy.text.index(stop)]
    for value in (stop, ["never in this text \u2603", stop]):  # a string, and one of a list
        r = chat(client, pipeline, temperature=0, stop=value)
        assert (r.text, r.finish_reason) == (expected, "stop"), (stop, greedy.text)
        assert r.completion_tokens < N
        assert r.ids == greedy.ids[: len(r.ids)]


def test_stop_in_a_stream(client, pipeline, greedy) -> None:
    stop = stop_string(greedy.text)
    stream = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=MESSAGES,
        max_tokens=N,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert ("".join(text), finish) == (greedy.text[: greedy.text.index(stop)], "stop")


def test_stop_in_a_text_completion(client, pipeline) -> None:
    prompt = "Once upon a time the kettle"
    ref = client.completions.create(
        model=pipeline.served_model_name,
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    stop = stop_string(ref.text)
    r = client.completions.create(
        model=pipeline.served_model_name,
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert (r.text, r.finish_reason) == (ref.text[: ref.text.index(stop)], "stop")


@pytest.mark.parametrize("n", [1, 7])
def test_max_completion_tokens_bounds_the_completion_like_max_tokens(client, pipeline, greedy, n) -> None:
    by_new = chat(client, pipeline, temperature=0, max_tokens=openai.NOT_GIVEN, max_completion_tokens=n)
    by_old = chat(client, pipeline, temperature=0, max_tokens=n)
    assert (by_new.completion_tokens, len(by_new.ids), by_new.finish_reason) == (n, n, "length")
    assert by_new.ids == greedy.ids[:n]
    assert by_new == by_old
