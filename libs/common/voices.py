"""The voice a request speaks with: the client's ``voice`` resolved against the pipeline's talker
(:func:`resolve_voice`, one rule set for every API that takes a voice)."""

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
"""OpenAI's built-in voice names; each stands for the talker's default voice."""


class UnknownVoice(ValueError):
    """A voice neither the talker's protocol nor OpenAI's built-ins have: 400 ``invalid_value``."""

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
    return next((s.talker for s in pipeline.stages if s.emits == Payload.CODEC_CODES), None)


def default_voice(talker: TalkerConfig) -> str | None:
    """The voice a talker speaks when a request names none: its ``voice``, else its protocol's first."""
    voices = TALKER_VOICES[talker.protocol]
    return talker.voice or (voices[0] if voices else None)


def resolve_voice(talker: TalkerConfig | None, asked: str | None, param: str = "voice") -> str | None:
    """The voice ``talker`` speaks a request with when the client asked for ``asked`` in ``param``:
    a protocol's voice as is; none or an OpenAI name: the default; None without a talker or
    voices. Anything else raises :class:`UnknownVoice`."""
    default = None if talker is None else default_voice(talker)
    if talker is None or default is None:  # no talker, or a protocol without voices
        return None
    voices = TALKER_VOICES[talker.protocol]
    if asked in voices:
        return asked
    if asked is None or asked in OPENAI_VOICES:
        return default
    raise UnknownVoice(asked, voices, default, param)
