"""The ``orpheus`` talker protocol: Orpheus TTS (``canopylabs/orpheus-3b-0.1-ft``, ``tiny-orpheus``).

Prompt of a text chunk: ``start_of_human``, the talker tokenizer's encoding of ``"{voice}: {text}"``,
then ``end_of_text``, ``end_of_human``, ``start_of_ai``, ``start_of_speech``. The response is SNAC
frames of 7 audio tokens, ended by ``end_of_speech``; audio token ``i`` is code ``id − first_audio −
(i mod 7) · codebook_size``, sent downstream as int32 ``[frames, 7]``. Every id comes from the
tokenizer by name (``<custom_token_N>``), the codebook size from the codec's ``config.json``, so a
tokenizer with Orpheus's layout at any scale works.

Generation is constrained per position inside the engine
(:mod:`services.stage_worker.engine_core.frame_logits`), capped at ``max_frames_per_char`` × the
text's characters (at least ``min_frames``); the decoder still checks every token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from libs.common.pipeline import TalkerConfig, TalkerProtocolName
from services.stage_worker.engine_core.frame_logits import FrameRule
from services.stage_worker.talkers.base import (
    CodeStream,
    TalkerInputError,
    TalkerOutputError,
    TalkerProtocol,
    TalkerRequest,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FRAME_SIZE = 7
"""Audio tokens per SNAC frame."""
FIRST_AUDIO_CUSTOM_TOKEN = 10
CONTROL_CUSTOM_TOKENS = {
    "start_of_speech": 1,
    "end_of_speech": 2,
    "start_of_human": 3,
    "end_of_human": 4,
    "start_of_ai": 5,
}
"""Orpheus's control tokens, by their ``<custom_token_N>`` number."""
END_OF_TEXT_TOKEN = "<|eot_id|>"
DEFAULT_SAMPLING: dict[str, float] = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}
"""Orpheus's reference sampling (its model card: repetition_penalty ≥ 1.1 is required)."""


def custom_token(n: int) -> str:
    return f"<custom_token_{n}>"


@dataclass(frozen=True)
class OrpheusTokens:
    """The token ids the protocol uses, read from a tokenizer's vocabulary."""

    end_of_text: int
    start_of_speech: int
    end_of_speech: int
    start_of_human: int
    end_of_human: int
    start_of_ai: int
    first_audio: int
    codebook_size: int
    reserved: frozenset[int]
    """Ids a text must not spell: the tokenizer's specials and every custom token."""

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, codebook_size: int) -> OrpheusTokens:
        """Ids by name; SystemExit naming the missing token when the vocabulary lacks one, or when
        the ``7 · codebook_size`` audio tokens are not consecutive after ``<custom_token_10>``."""
        vocab = tokenizer.get_vocab()
        last_custom = FIRST_AUDIO_CUSTOM_TOKEN + FRAME_SIZE * codebook_size - 1

        def need(token: str) -> int:
            if token not in vocab:
                raise SystemExit(
                    f"talker tokenizer has no {token}: not Orpheus's layout for a codec of codebook_size "
                    f"{codebook_size} (needs <custom_token_0> ... {custom_token(last_custom)})"
                )
            return vocab[token]

        first_audio = need(custom_token(FIRST_AUDIO_CUSTOM_TOKEN))
        for n in range(FIRST_AUDIO_CUSTOM_TOKEN, last_custom + 1):
            if need(custom_token(n)) != first_audio + n - FIRST_AUDIO_CUSTOM_TOKEN:
                raise SystemExit(
                    f"talker tokenizer: {custom_token(n)} is not right after {custom_token(n - 1)}"
                )
        customs = {i for t, i in vocab.items() if t.startswith("<custom_token_")}
        return cls(
            end_of_text=need(END_OF_TEXT_TOKEN),
            **{name: need(custom_token(n)) for name, n in CONTROL_CUSTOM_TOKENS.items()},
            first_audio=first_audio,
            codebook_size=codebook_size,
            reserved=frozenset(customs | set(tokenizer.all_special_ids)),
        )


def codec_codebook_size(codec_model: str) -> int:
    """``codebook_size`` of the codec model ``codec_model`` (a local directory, or a Hugging Face
    repo id found in the local cache): the field of its ``config.json``."""
    path = Path(codec_model) / "config.json"
    if not Path(codec_model).is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(codec_model, "config.json")
        if not isinstance(cached, str):
            raise SystemExit(
                f"codec model {codec_model}: no local directory and no config.json in the HF cache"
            )
        path = Path(cached)
    try:
        size = json.loads(path.read_text())["codebook_size"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: cannot read field 'codebook_size': {e!r}") from None
    if not isinstance(size, int) or size < 1:
        raise SystemExit(f"{path}: field 'codebook_size' must be a positive integer, got {size!r}")
    return size


class OrpheusCodeStream(CodeStream):
    """Audio tokens -> ``[frames, 7]`` codes, checking each is in its position's block."""

    def __init__(self, tokens: OrpheusTokens) -> None:
        self._t = tokens
        self._partial: list[int] = []
        self._stopped = False

    def feed(self, token_ids: Sequence[int]) -> np.ndarray:
        frames: list[list[int]] = []
        size = self._t.codebook_size
        for tid in token_ids:
            if self._stopped:
                raise TalkerOutputError(f"token {tid} after end_of_speech")
            slot = len(self._partial)
            if tid == self._t.end_of_speech and slot == 0:
                self._stopped = True
                continue
            code = tid - self._t.first_audio - slot * size
            if not 0 <= code < size:
                raise TalkerOutputError(
                    f"token {tid} at frame position {slot} is not an audio code of that position"
                )
            self._partial.append(code)
            if len(self._partial) == FRAME_SIZE:
                frames.append(self._partial)
                self._partial = []
        return np.asarray(frames, dtype=np.int32).reshape(-1, FRAME_SIZE)

    @property
    def stopped(self) -> bool:
        return self._stopped


class OrpheusProtocol(TalkerProtocol):
    name = TalkerProtocolName.ORPHEUS
    frame_size = FRAME_SIZE

    def __init__(self, config: TalkerConfig, tokenizer: PreTrainedTokenizerBase, codebook_size: int) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer
        self.tokens = OrpheusTokens.of(tokenizer, codebook_size)

    @classmethod
    def from_model_dirs(cls, config: TalkerConfig, model_dir: str, codec_model: str) -> OrpheusProtocol:
        """The protocol of the talker in ``model_dir`` feeding the codec ``codec_model``."""
        from transformers import AutoTokenizer

        return cls(config, AutoTokenizer.from_pretrained(model_dir), codec_codebook_size(codec_model))

    def prompt(self, text: str, voice: str | None = None) -> list[int]:
        """The prompt token ids of ``text`` (stripped) spoken by ``voice`` (the stage's default if
        None); :class:`TalkerInputError` if the text spells a special or custom token."""
        said = f"{self.resolve_voice(voice)}: {text.strip()}"
        plain = self.tokenizer(said, add_special_tokens=False).input_ids
        spelled = sorted(set(plain) & self.tokens.reserved)
        if spelled:
            names = self.tokenizer.convert_ids_to_tokens(spelled)
            raise TalkerInputError(f"text spells reserved tokens {names}")
        t = self.tokens
        encoded = self.tokenizer(said).input_ids
        return [t.start_of_human, *encoded, t.end_of_text, t.end_of_human, t.start_of_ai, t.start_of_speech]

    def request(
        self, text: str, token_ids: Sequence[int], *, voice: str | None = None, seed: int | None = None
    ) -> TalkerRequest | None:
        """Stops at end_of_speech; at most the text's cap of frames (then end_of_speech is forced,
        hence ``max_tokens`` = 7 · frames + 1); Orpheus's sampling with the YAML's overrides. None
        for a blank text."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not text.strip():
            self.resolve_voice(voice)
            return None
        t = self.tokens
        cap = max(self.config.min_frames, math.ceil(self.config.max_frames_per_char * len(text.strip())))
        rule = FrameRule(t.first_audio, t.codebook_size, FRAME_SIZE, t.end_of_speech, max_frames=cap)
        params = SamplingParams(
            max_tokens=rule.max_frames * FRAME_SIZE + 1,
            stop_token_ids=[t.end_of_speech],
            seed=seed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=rule.to_extra_args(),
            **{**DEFAULT_SAMPLING, **self.sampling_overrides()},
        )
        return TalkerRequest(
            prompt_token_ids=self.prompt(text, voice), params=params, max_codes=rule.max_frames * FRAME_SIZE
        )

    def code_stream(self) -> OrpheusCodeStream:
        return OrpheusCodeStream(self.tokens)
