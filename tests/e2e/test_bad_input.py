"""Bad input: a 4xx in OpenAI's error shape, and the service keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def http(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=60)


def _post(http: httpx.Client, body: dict | str, path: str = "/v1/chat/completions") -> httpx.Response:
    if isinstance(body, str):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """``r`` is ``status`` in OpenAI's error shape (exactly message, type, param, code); a 400's
    ``type`` is OpenAI's ``invalid_request_error``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if status == 400:
        assert err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _msgs() -> list[dict]:
    return [{"role": "user", "content": "hi"}]


INVALID = "invalid_request"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ("{not json", 400, None, INVALID),
        ({"model": "nope", "messages": _msgs()}, 404, "model", "model_not_found"),
        ({"model": "omni-tiny"}, 400, "messages", INVALID),
        ({"model": "omni-tiny", "messages": []}, 400, "messages", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "max_tokens": -3}, 400, "max_tokens", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "max_tokens": 0}, 400, "max_tokens", INVALID),
        (
            {"model": "omni-tiny", "messages": _msgs(), "max_tokens": 10**9},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": "omni-tiny", "messages": _msgs(), "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
            INVALID,
        ),
        (
            {"model": "omni-tiny", "messages": _msgs(), "max_completion_tokens": 10**9},
            400,
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": "omni-tiny", "messages": _msgs(), "modalities": ["text", "video"]},
            400,
            "modalities",
            "unsupported_modality",
        ),
        (
            {
                "model": "omni-tiny",
                "messages": _msgs(),
                "modalities": ["text", "audio"],
                "audio": {"format": "aac"},  # a speech format, not one of chat's
            },
            400,
            "audio.format",
            "unsupported_audio_format",
        ),
        ({"model": "omni-tiny", "messages": _msgs(), "n": 2}, 400, "n", INVALID),
        (
            {"model": "omni-tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages.0.content.0.type",
            "unsupported_content",
        ),
        (  # an audio part with no audio in it
            {
                "model": "omni-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                    }
                ],
            },
            400,
            "messages.0.content.0.input_audio.data",
            "invalid_audio",
        ),
        (
            {"model": "omni-tiny", "messages": _msgs(), "tools": [{"type": "function"}]},
            400,
            "tools",
            "unsupported_parameter",
        ),
        ({"model": "omni-tiny", "messages": _msgs(), "temperature": 7}, 400, "temperature", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "top_p": 0}, 400, "top_p", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "top_p": 1.5}, 400, "top_p", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "stop": 5}, 400, None, INVALID),
        # vLLM's own OpenAI server takes a seed within a signed 64-bit integer.
        ({"model": "omni-tiny", "messages": _msgs(), "seed": 2**63}, 400, "seed", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "seed": -(2**63) - 1}, 400, "seed", INVALID),
        ({"model": "omni-tiny", "messages": _msgs(), "seed": 2**64}, 400, "seed", INVALID),
    ],
)
def test_bad_chat_request_is_rejected(http, body, status, param, code) -> None:
    _assert_error(_post(http, body), status, param, code)


def test_prompt_longer_than_the_model_allows(http, pipeline) -> None:
    long_text = "the weather is lovely today and the kettle is on " * 400
    body = {"model": pipeline.served_model_name, "messages": [{"role": "user", "content": long_text}]}
    err = _assert_error(_post(http, body), 400, code="context_length_exceeded")
    assert str(pipeline.thinker.engine.max_model_len) in err["message"]
    err = _assert_error(
        _post(http, {"model": pipeline.served_model_name, "prompt": long_text}, "/v1/completions"), 400
    )
    assert err["code"] == "context_length_exceeded"


async def test_openai_client_sees_typed_errors_and_service_keeps_serving(stack, pipeline) -> None:
    client = stack.client()
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=_msgs())
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=pipeline.served_model_name, messages=_msgs(), max_tokens=-1
        )
    ok = await client.chat.completions.create(
        model=pipeline.served_model_name, messages=_msgs(), max_tokens=3
    )
    assert ok.choices[0].message.content is not None
    await client.close()
