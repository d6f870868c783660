"""Per-position constraint of a talker's audio tokens: a vLLM v1 logits processor (engine process).

A talker that emits codec frames of ``frame_size`` tokens (Orpheus: 7 SNAC tokens) must give, at
audio position ``i`` of its response, a token of that position's block ``[first_audio + (i mod
frame_size) * codebook_size, ... + codebook_size)``. Random weights (the tiny models) never do, so
this processor makes it a rule, per request, before vLLM's penalties, temperature and top-p:

- at position ``i`` only the tokens of block ``i mod frame_size`` may be sampled;
- the stop token only on a frame boundary, once the response holds ``min_frames`` frames;
- at ``max_frames`` frames the stop token is the only choice.

The rule travels in ``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` (:class:`FrameRule`'s fields);
requests without it are left alone. With asynchronous scheduling vLLM keeps a placeholder in a
request's output token list for each token in flight, so the list's length is the position sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

EXTRA_ARGS_KEY = "omnirelay_frames"
FRAME_LOGITS_PROCESSOR = f"{__name__}:FrameLogitsProcessor"
"""How the worker names the processor to vLLM (``<module>:<class>``)."""


@dataclass(frozen=True)
class FrameRule:
    """Which token ids one request may sample at each position of its response: block ``p`` (frame
    position ``p``) is ``codebook_size`` ids from ``first_audio + p * codebook_size``; ``stop_id`` is
    allowed from ``min_frames`` frames on, forced at ``max_frames``."""

    first_audio: int
    codebook_size: int
    frame_size: int
    stop_id: int
    max_frames: int
    min_frames: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{EXTRA_ARGS_KEY}.{f.name} must be a non-negative integer, got {value!r}")
        if self.codebook_size < 1 or self.frame_size < 1 or self.max_frames < 1:
            raise ValueError(f"{EXTRA_ARGS_KEY}: codebook_size, frame_size and max_frames must be at least 1")
        if self.min_frames > self.max_frames:
            raise ValueError(f"{EXTRA_ARGS_KEY}: min_frames {self.min_frames} > max_frames {self.max_frames}")
        audio_end = self.first_audio + self.frame_size * self.codebook_size
        if self.first_audio <= self.stop_id < audio_end:
            raise ValueError(f"{EXTRA_ARGS_KEY}: stop_id {self.stop_id} lies inside the audio tokens")

    @classmethod
    def of(cls, params: SamplingParams) -> FrameRule | None:
        """The rule a request carries, or None."""
        raw = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"{EXTRA_ARGS_KEY} must be a mapping, got {type(raw).__name__}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{EXTRA_ARGS_KEY}: {e}") from None

    def allowed(self, position: int) -> tuple[int, int, bool]:
        """At response position ``position`` (0-based): ``(lo, hi, stop_ok)``, the audio ids
        ``[lo, hi)`` and whether the stop token may be sampled."""
        frame, slot = divmod(position, self.frame_size)
        if frame >= self.max_frames:
            return 0, 0, True
        lo = self.first_audio + slot * self.codebook_size
        return lo, lo + self.codebook_size, slot == 0 and frame >= self.min_frames

    def to_extra_args(self) -> dict[str, Any]:
        """``SamplingParams.extra_args`` carrying this rule."""
        return {EXTRA_ARGS_KEY: {f.name: getattr(self, f.name) for f in fields(self)}}


class FrameLogitsProcessor(LogitsProcessor):
    """Masks, for each request carrying a :class:`FrameRule`, every token its position does not
    allow (a few batched tensor operations per step, whatever the batch size)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[FrameRule, Sequence[int]]] = {}
        """Batch row -> (rule, the request's live output token list)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        FrameRule.of(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_row(params: SamplingParams, _prompt: list[int] | None, output: list[int]):
            rule = FrameRule.of(params)
            return None if rule is None else (rule, output)

        process_dict_updates(self._rows, batch_update, new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Each ruled row becomes -inf except its position's block and, where allowed, the stop
        token: the kept values are gathered, the rows filled, the values put back (one write of
        the rows, a gather and a scatter of ``codebook_size`` values per row)."""
        if not self._rows:
            return logits
        groups: dict[int, list[tuple[int, int, bool, int, bool]]] = {}
        for row, (rule, output) in self._rows.items():
            lo, hi, stop_ok = rule.allowed(len(output))
            groups.setdefault(rule.codebook_size, []).append((row, lo, hi > lo, rule.stop_id, stop_ok))
        for size, entries in groups.items():
            row, lo, audio_ok, stop, stop_ok = (
                torch.tensor(column, device=logits.device) for column in zip(*entries, strict=True)
            )
            cols = lo[:, None] + torch.arange(size, device=logits.device)
            block = logits[row[:, None], cols].masked_fill(~audio_ok[:, None], float("-inf"))
            stop_values = logits[row, stop].masked_fill(~stop_ok, float("-inf"))
            logits.index_fill_(0, row, float("-inf"))
            logits[row[:, None], cols] = block
            logits[row, stop] = stop_values
        return logits
