"""An empty ``stop`` string is the client's error (400 on ``stop``), answered before anything is
queued; it was a 500 ``stage_error`` (vLLM's ``SamplingParams`` refuses it in the worker), found by
the schema fuzzer (tests/e2e/test_fuzz_http.py)."""

from __future__ import annotations

import pytest

from services.gateway.errors import APIError
from services.gateway.prompting import sampling_for
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "req",
    [
        ChatCompletionRequest(model="m", messages=MSGS, stop=["\n", ""]),
        ChatCompletionRequest(model="m", messages=MSGS, stop=""),
        CompletionRequest(model="m", prompt="hi", stop=[""]),
    ],
)
def test_an_empty_stop_string_is_a_400_on_stop(req) -> None:
    with pytest.raises(APIError) as e:
        sampling_for(req, 4)
    assert (e.value.status, e.value.param, e.value.code) == (400, "stop", "invalid_request")


def test_other_stop_strings_pass() -> None:
    req = ChatCompletionRequest(model="m", messages=MSGS, stop=["\n", " "])
    assert sampling_for(req, 4).stop == ["\n", " "]
