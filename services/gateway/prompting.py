"""Turning an API request into the thinker's prompt tokens and sampling parameters, with the
limits checked here so bad input is answered before anything is queued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from libs.common.envelopes import Sampling
from libs.common.pipeline import PipelineConfig
from libs.common.voices import UnknownVoice, resolve_voice, talker_config
from services.gateway.errors import APIError, bad_request
from services.gateway.schemas import (
    AudioParams,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    InputAudio,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "pcm16")
"""``audio.format`` values served (OpenAI's list). Streamed audio is always raw PCM16 chunks, as
OpenAI streams it; a non-streamed answer is the whole file in the format."""


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` values naming transformers' generic fast tokenizer (its name before and
since transformers 5): the class ``AutoTokenizer`` picks for them, built here directly."""


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer ``AutoTokenizer`` loads from ``model_path``. A model directory whose
    ``tokenizer_config.json`` names the generic fast tokenizer gets that class directly:
    ``AutoTokenizer`` would first import its model configuration classes, and with them torch
    (about 2.5 s of a core for a gateway that runs no model)."""
    config = Path(model_path) / "tokenizer_config.json"
    if (
        config.is_file()
        and json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
    ):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class Tokenizer:
    """The thinker's tokenizer (loaded with transformers from the stage's model directory)."""

    def __init__(self, model_path: str) -> None:
        self._tok = load_tokenizer(model_path)
        self._tok.model_max_length = 1 << 62  # the limit is checked here, against the engine's max_model_len

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's tokens; 400 ``invalid_request`` on ``messages`` when the model's chat
        template refuses them (a role it does not take, such as ``tool``; tests/e2e/test_fuzz_http.py)."""
        from jinja2 import TemplateError

        try:
            text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:
            raise bad_request(
                f"the model's chat template does not take these messages: {e}", "messages"
            ) from None
        return self._tok.encode(text, add_special_tokens=False)

    def text(self, prompt: str) -> list[int]:
        return self._tok.encode(prompt, add_special_tokens=True)

    def words(self, text: str) -> list[int]:
        """``text``'s tokens without special ones: what a thinker's text chunk of it would carry."""
        return self._tok.encode(text, add_special_tokens=False)


def chat_messages(messages: list[ChatMessage], heard: dict[tuple[int, int], str]) -> list[dict[str, str]]:
    """Messages as plain ``{role, content}`` text: text parts as they are, ``input_audio`` parts
    as the listener heard them (``heard``: (message, part) → transcript); others are rejected."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            parts = []
            for j, p in enumerate(m.content):
                if p.type == "input_audio" and (i, j) in heard:
                    parts.append(heard[i, j])
                    continue
                if p.type != "text" or p.text is None:
                    raise bad_request(
                        f"content part type '{p.type}' is not supported (text, input_audio)",
                        f"messages.{i}.content.{j}.type",
                        "unsupported_content",
                    )
                parts.append(p.text)
            text = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": text})
    return out


def audio_parts(messages: list[ChatMessage]) -> dict[tuple[int, int], InputAudio]:
    """The ``input_audio`` parts of ``messages``: (message, part) → the part's audio; a part of
    that type without its audio is a 400."""
    found = {}
    for i, m in enumerate(messages):
        for j, p in enumerate(m.content if isinstance(m.content, list) else ()):
            if p.type != "input_audio":
                continue
            if p.input_audio is None:
                raise bad_request(
                    "an input_audio part needs 'input_audio'", f"messages.{i}.content.{j}.input_audio"
                )
            found[i, j] = p.input_audio
    return found


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """The generation budget: what was asked for, or what is left of the context; 400 when
    the prompt or the request does not fit."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's maximum context length is "
            f"{max_model_len} tokens (prompt plus at least one generated token)",
            "messages",
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {prompt_len} "
            f"prompt tokens plus {param}={requested} is {prompt_len + requested}",
            param,
            "context_length_exceeded",
        )
    return requested


def wants_audio(req: ChatCompletionRequest, pipeline: PipelineConfig) -> AudioParams | None:
    """The audio output parameters when the request asks for audio, else None."""
    mods = req.modalities or ["text"]
    unknown = [m for m in mods if m not in ("text", "audio")]
    if unknown:
        raise bad_request(
            f"unsupported modality {unknown[0]!r} (text, audio)", "modalities", "unsupported_modality"
        )
    if "audio" not in mods:
        return None
    if pipeline.audio_stage is None:
        raise bad_request(
            f"pipeline '{pipeline.name}' produces no audio", "modalities", "unsupported_modality"
        )
    audio = req.audio or AudioParams()
    if audio.format not in AUDIO_FORMATS:
        raise bad_request(
            f"audio.format {audio.format!r} is not supported ({', '.join(AUDIO_FORMATS)})",
            "audio.format",
            "unsupported_audio_format",
        )
    return audio


def audio_voice(audio: AudioParams, pipeline: PipelineConfig) -> str | None:
    """The voice the talker speaks the request with (None: a talker without voices); an unknown
    voice is a 400 ``invalid_value`` on ``audio.voice`` listing the voices there are."""
    return voice_of(audio.voice_name, pipeline, "audio.voice")


def voice_of(asked: str | None, pipeline: PipelineConfig, param: str, code: str | None = None) -> str | None:
    """:func:`libs.common.voices.resolve_voice` for parameter ``param``; an unknown voice is a 400
    (``code``, else ``invalid_value``) listing the voices there are."""
    try:
        return resolve_voice(talker_config(pipeline), asked, param)
    except UnknownVoice as e:
        raise APIError(e.status, str(e), code or e.code, e.param) from None


def sampling_for(req: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> Sampling:
    if req.n != 1:
        raise bad_request("only n=1 is supported", "n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if "" in stop:  # vLLM would refuse it in the worker, as a stage error
        raise bad_request("stop cannot contain an empty string", "stop")
    return Sampling(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


UNSUPPORTED_CHAT_FIELDS = ("tools", "tool_choice", "functions", "function_call", "response_format")


def reject_unsupported(req: ChatCompletionRequest) -> None:
    extra = req.model_extra or {}
    for name in UNSUPPORTED_CHAT_FIELDS:
        if extra.get(name) not in (None, [], "none", {"type": "text"}):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    if extra.get("logprobs"):
        raise bad_request("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")
