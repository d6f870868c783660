"""A moved thinker request's new attempt streams the text the fault-free run streams
(services/stage_worker/resumed_text.py), with the tiny thinker's tokenizer as the engine loads it.

Ground truth: vLLM's own incremental detokenizer, started on the prompt and fed one token at a
time, as vLLM's output processor feeds it in a run without a fault; its deltas are what a client
of that run receives. The tokens are random (the tiny thinker's own output is too), so the seams
land inside characters as they did in the chaos soak."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from libs.models.tiny import resolve_model
from services.stage_worker.resumed_text import ResumedText, engine_params

TRIALS = 200


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(resolve_model("tiny-thinker"))


def _request(prompt: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt, None, params, None, 0.0, None, None, None)


def _fault_free(
    tokenizer, prompt: list[int], tokens: list[int], params: SamplingParams, ends: bool = True
) -> tuple[list[str], int]:
    """The deltas a client of the fault-free run gets, one per token, and how many tokens it
    gets (fewer when a stop string ends the text); ``ends``: the run ends with ``tokens`` (else
    they are what it had streamed when a move came)."""
    detok = IncrementalDetokenizer.from_new_request(tokenizer, _request(prompt, params))
    deltas = []
    for i, t in enumerate(tokens):
        stop = detok.update([t], stop_terminated=False)
        finished = stop is not None or (ends and i == len(tokens) - 1)
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            return deltas, len(detok.output_token_ids)
    return deltas, len(tokens)


def _draws(tokenizer, seed: int) -> tuple[list[int], list[int], int]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompt = [rng.randrange(vocab) for _ in range(6)]
    tokens = [rng.randrange(vocab) for _ in range(40)]
    return prompt, tokens, rng.randrange(1, len(tokens))


def _resumed(tokenizer, prompt, tokens, at, params) -> tuple[str, list[int], str | None]:
    """A move after token ``at``: the client's text from the fault-free deltas, then what the
    new attempt sends for the rest, fed in steps of one or two tokens."""
    client_text = "".join(_fault_free(tokenizer, prompt, tokens[:at], params, ends=False)[0])
    text = ResumedText(tokenizer, "r", prompt, tokens[:at], params)
    sent_text, sent_ids, stop = "", list(tokens[:at]), None
    rest = tokens[at:]
    i = 0
    while i < len(rest) and stop is None:
        step = rest[i : i + 1 + (i % 2)]
        i += len(step)
        ids, delta, stop = text.feed(step, finished=i >= len(rest), eos=False)
        sent_text += delta
        sent_ids += ids
    return client_text + sent_text, sent_ids, stop


def test_the_client_text_before_the_seam_is_the_fault_free_runs(tokenizer) -> None:
    params = SamplingParams()
    for seed in range(TRIALS):
        prompt, tokens, at = _draws(tokenizer, seed)
        streamed = "".join(_fault_free(tokenizer, prompt, tokens[:at], params, ends=False)[0])
        assert ResumedText(tokenizer, "r", prompt, tokens[:at], params).client_text == streamed, seed


def test_a_resumed_attempt_streams_the_fault_free_text_at_every_seam(tokenizer) -> None:
    params = SamplingParams()
    naive_differs = 0
    for seed in range(TRIALS):
        prompt, tokens, at = _draws(tokenizer, seed)
        want = "".join(_fault_free(tokenizer, prompt, tokens, params)[0])
        got, ids, stop = _resumed(tokenizer, prompt, tokens, at, params)
        assert (got, ids, stop) == (want, tokens, None), (seed, at)
        # What the engine decodes itself when given the client's tokens as its prompt:
        first, _ = _fault_free(tokenizer, prompt, tokens[:at], params, ends=False)
        detok = IncrementalDetokenizer.from_new_request(tokenizer, _request(prompt + tokens[:at], params))
        detok.update(tokens[at:], stop_terminated=False)
        naive = "".join(first) + detok.get_next_output_text(True, delta=True)
        naive_differs += naive != want
    # The seams this test draws are ones where the engine's own decoding goes wrong.
    assert naive_differs > 0


def test_a_stop_string_is_found_across_the_seam_and_ends_the_text(tokenizer) -> None:
    found = 0
    for seed in range(TRIALS):
        prompt, tokens, at = _draws(tokenizer, seed)
        full = "".join(_fault_free(tokenizer, prompt, tokens, SamplingParams())[0])
        # A stop string of 3 characters that the fault-free text has after the seam's first
        # character of new text: it may begin before the seam.
        start = len("".join(_fault_free(tokenizer, prompt, tokens[:at], SamplingParams(), ends=False)[0]))
        if len(full) < start + 4:
            continue
        stop_at = max(start - 1, 0)
        stop_string = full[stop_at : stop_at + 3]
        params = SamplingParams(stop=[stop_string])
        want_deltas, want_count = _fault_free(tokenizer, prompt, tokens, params)
        if want_count <= at:  # the fault-free run stopped before the seam: no move to make
            continue
        got, ids, stop = _resumed(tokenizer, prompt, tokens, at, params)
        assert (got, ids, stop) == ("".join(want_deltas), tokens[:want_count], stop_string), (seed, at)
        found += 1
    assert found > TRIALS // 4, found


def test_the_engine_of_a_resumed_attempt_neither_decodes_nor_stops_on_strings() -> None:
    params = SamplingParams(stop=["abc"], max_tokens=7, temperature=0.5, seed=3)
    engine = engine_params(params)
    assert (engine.stop, engine.detokenize, engine.output_text_buffer_length) == ([], False, 0)
    assert (engine.max_tokens, engine.temperature, engine.seed) == (7, 0.5, 3)
    assert params.stop == ["abc"] and params.detokenize  # the caller's are untouched
