"""The voice a request speaks with: the client's ``voice`` resolved against the pipeline's talker.

One rule set for every API that takes a voice (chat completions' ``audio.voice``, the speech
API's ``voice``), applied by the gateway before anything is published:

- a voice the talker's protocol has: that voice;
- one of OpenAI's built-in voice names (:data:`OPENAI_VOICES`): the talker stage's default voice
  (its YAML ``talker.voice``, else the protocol's first), so clients that send ``alloy`` out of
  habit keep working;
- no voice asked: the stage's default voice;
- a protocol without voices (``tiny``, one sound): None, whatever was asked;
- anything else: :class:`UnknownVoice` (a 400 ``invalid_value`` listing the voices there are).

The resolved voice (None: the stage's default) travels in ``Admission.voice`` and the request's
record (``RequestRecord.voice``), where every attempt of the talker reads it.
"""

from __future__ import annotations

from libs.common.pipeline import TALKER_VOICES, Payload, PipelineConfig, TalkerConfig

OPENAI_VOICES: tuple[str, ...] = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
"""OpenAI's built-in voice names (its API reference for ``audio.voice`` and ``/v1/audio/speech``);
each stands for the talker's default voice."""


class UnknownVoice(ValueError):
    """A voice neither the talker's protocol nor OpenAI's built-ins have: a client error, 400
    ``invalid_value`` on the parameter ``param``; the message lists the voices the pipeline has."""

    status = 400
    code = "invalid_value"

    def __init__(self, voice: str, voices: tuple[str, ...], default: str, param: str) -> None:
        self.voice, self.voices, self.param = voice, voices, param
        super().__init__(
            f"{param} {voice!r} is not a voice of this pipeline; its voices are {', '.join(voices)} "
            f"(OpenAI's built-in names, such as 'alloy', speak in its default voice, {default})"
        )


def talker_config(pipeline: PipelineConfig) -> TalkerConfig | None:
    """The talker config of ``pipeline``'s stage that emits codec codes, None without one."""
    for stage in pipeline.stages:
        if stage.emits == Payload.CODEC_CODES:
            return stage.talker
    return None


def default_voice(talker: TalkerConfig) -> str | None:
    """The voice a talker stage speaks with when a request names none: its YAML ``voice``, else
    its protocol's first; None for a protocol without voices."""
    voices = TALKER_VOICES[talker.protocol]
    return talker.voice or (voices[0] if voices else None)


def resolve_voice(talker: TalkerConfig | None, asked: str | None, param: str = "voice") -> str | None:
    """The voice talker stage ``talker`` speaks a request with when the client asked for
    ``asked`` (None: not given) in parameter ``param`` (named in the error); None when the
    pipeline has no talker or its protocol has no voices. Raises :class:`UnknownVoice`."""
    if talker is None:
        return None
    default = default_voice(talker)
    if default is None:  # a protocol without voices
        return None
    voices = TALKER_VOICES[talker.protocol]
    if asked in voices:
        return asked
    if asked is None or asked in OPENAI_VOICES:
        return default
    raise UnknownVoice(asked, voices, default, param)
