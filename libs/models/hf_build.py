"""What the tiny model generators share: the byte-level BPE text vocabulary trained on the bundled
corpus, and quiet saving with transformers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.utils import logging as hf_logging

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
TEXT_VOCAB_SIZE = 2000
"""Tokens of the trained text vocabulary (the special tokens given to the trainer included)."""


def train_text_bpe(special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``corpus.txt`` (deterministic), with
    ``special_tokens`` first in its vocabulary (ids 0, 1, …) and no post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    return tok


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars for the duration (restores the previous setting)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
