"""tiny-orpheus: Orpheus TTS's tokenizer layout at a small scale, loadable by transformers, and the
same bytes on every generation."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from libs.models.hf_build import TEXT_VOCAB_SIZE
from libs.models.tiny_orpheus import build_tiny_orpheus
from libs.models.tiny_snac import CODEBOOK_SIZE

# Orpheus's layout, as its real tokenizer has it (offsets from the end of Llama 3's text vocabulary,
# 128000): <|begin_of_text|> +0, <|eot_id|> +9, then <custom_token_N> at +256 + N in the real one;
# the tiny one keeps Llama 3.2's first ten specials only, so its custom tokens start at +10.
LLAMA3_FIRST_TEN = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-orpheus")
    build_tiny_orpheus(d)
    return d


def test_files_are_the_real_checkpoint_layout(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = AutoConfig.from_pretrained(str(model_dir))
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert config.tie_word_embeddings and config.rope_parameters["rope_type"] == "llama3"


def test_special_and_custom_token_ids_follow_orpheus_layout(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = tok.get_vocab()
    for i, name in enumerate(LLAMA3_FIRST_TEN):
        assert vocab[name] == TEXT_VOCAB_SIZE + i, name
    first_custom = TEXT_VOCAB_SIZE + len(LLAMA3_FIRST_TEN)
    num_custom = 10 + 7 * CODEBOOK_SIZE
    for n in range(num_custom):
        assert vocab[f"<custom_token_{n}>"] == first_custom + n
    assert f"<custom_token_{num_custom}>" not in vocab
    assert len(tok) == first_custom + num_custom
    # Llama 3's tokenizer starts every encoding with <|begin_of_text|>; the specials are single tokens
    ids = tok("tara: Hello there.").input_ids
    assert ids[0] == TEXT_VOCAB_SIZE and all(i < TEXT_VOCAB_SIZE for i in ids[1:])
    assert tok.decode(ids[1:]) == "tara: Hello there."
    assert tok("<custom_token_2><|eot_id|>", add_special_tokens=False).input_ids == [
        first_custom + 2,
        TEXT_VOCAB_SIZE + 9,
    ]
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|eot_id|>"


def test_model_loads_and_scores_the_whole_vocabulary(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([tok("tara: hi").input_ids])).logits
    assert logits.shape[-1] == len(tok) == model.config.vocab_size
    assert model.config.bos_token_id == tok.bos_token_id and model.config.eos_token_id == tok.eos_token_id


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_generation_is_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    build_tiny_orpheus(tmp_path)
    assert _hashes(tmp_path) == _hashes(model_dir)
