"""The talker protocol interface: what a model family decides about a talker's engine requests."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from libs.common.pipeline import TALKER_VOICES, TalkerConfig, TalkerProtocolName
from libs.common.voices import default_voice

if TYPE_CHECKING:
    from vllm import SamplingParams


class UnknownVoice(ValueError):
    """A voice the protocol does not have; the message lists the voices it has (a client error)."""


class TalkerInputError(ValueError):
    """A text chunk the protocol cannot turn into a prompt (e.g. it spells a control token)."""


class TalkerOutputError(ValueError):
    """An engine output token that is not the code its position requires."""


@dataclass(frozen=True)
class TalkerRequest:
    """One engine request of a talker: a text chunk's prompt and sampling."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_codes: int
    """Most codes the request can yield (``tiny``: exactly this many)."""


class CodeStream(ABC):
    """Turns one engine request's output token ids, fed as they stream, into codec codes."""

    @abstractmethod
    def feed(self, token_ids: Sequence[int]) -> np.ndarray:
        """Codes completed by ``token_ids`` (the request's next output tokens), int32: 1-D for a
        protocol whose frame is one code, ``[frames, frame_size]`` otherwise."""

    @property
    @abstractmethod
    def stopped(self) -> bool:
        """The protocol's stop token has been fed."""


class TalkerProtocol(ABC):
    """How a talker stage turns a text chunk into codec codes: the prompt, the sampling and its stop,
    the cap, and how output token ids become codes (one instance per worker)."""

    name: TalkerProtocolName
    frame_size: int
    """Codes per frame (``StageTask.codes`` is ``[frames, frame_size]`` when above 1, else 1-D)."""

    def __init__(self, config: TalkerConfig) -> None:
        self.config = config
        self.default_voice: str | None = default_voice(config)
        """The stage's voice (its YAML ``voice``, checked at load, else the protocol's first)."""

    @property
    def fixed_codes_per_token(self) -> int | None:
        """Codes each thinker token makes, when the protocol fixes it (``tiny``: code chunks numbered
        by code position); None (``orpheus``: each text chunk makes a segment of frames)."""
        return None

    @property
    def voices(self) -> tuple[str, ...]:
        """The voices a request may ask for (empty: the protocol takes none)."""
        return TALKER_VOICES[self.name]

    def resolve_voice(self, voice: str | None) -> str | None:
        """The voice a request speaks with: its own, or the stage's default if None;
        :class:`UnknownVoice` if the protocol does not have it."""
        if voice is None or voice in self.voices:
            return self.default_voice if voice is None else voice
        known = ", ".join(self.voices) if self.voices else "none"
        raise UnknownVoice(
            f"unknown voice '{voice}' for talker protocol '{self.name.value}' (voices: {known})"
        )

    def sampling_overrides(self) -> dict[str, Any]:
        """The YAML's sampling overrides (only the fields it sets)."""
        return self.config.sampling.model_dump(exclude_none=True)

    @abstractmethod
    def request(
        self, text: str, token_ids: Sequence[int], *, voice: str | None = None, seed: int | None = None
    ) -> TalkerRequest | None:
        """The engine request of a text chunk (``text``, and its thinker ``token_ids``), or None
        when the chunk has nothing to say. Streams DELTA outputs, no detokenisation."""

    @abstractmethod
    def code_stream(self) -> CodeStream:
        """A fresh decoder of one engine request's output."""
