"""``tiny-orpheus``: a tiny random-weight Orpheus TTS talker, generated locally and deterministically.

Orpheus (``canopylabs/orpheus-3b-0.1-ft``) is a Llama-3.2 ``LlamaForCausalLM`` whose tokenizer is
Llama 3's (text tokens, then 256 special tokens from ``<|begin_of_text|>`` = 128000, with
``<|eot_id|>`` = 128009) followed by added tokens ``<custom_token_N>`` = 128256 + N. The first ten
custom tokens are control tokens, the rest are audio tokens, seven codebook-sized blocks of them (one
per position of a 7-token SNAC frame):

====================  ==============  ===================
custom token          Orpheus's name  real id
====================  ==============  ===================
``<custom_token_1>``  start_of_speech 128257
``<custom_token_2>``  end_of_speech   128258
``<custom_token_3>``  start_of_human  128259
``<custom_token_4>``  end_of_human    128260
``<custom_token_5>``  start_of_ai     128261
``<custom_token_6>``  end_of_ai       128262
``<custom_token_7>``  pad             128263
``<custom_token_10>`` first audio     128266
====================  ==============  ===================

This model has the same layout at a small scale: a byte-level BPE text vocabulary trained on the
bundled ``corpus.txt`` (``TEXT_VOCAB_SIZE`` tokens, no specials among them), then Llama 3.2's first
ten special tokens in Llama's order (``<|begin_of_text|>`` ... ``<|eot_id|>``), then
``<custom_token_0>`` ... ``<custom_token_{10 + 7 * CODEBOOK_SIZE - 1}>``. Like Llama 3's, the
tokenizer puts ``<|begin_of_text|>`` before every encoded text. The weights are a seeded random
Llama (hidden 128, 2 layers, Llama 3.2's rope scaling and tied embeddings), saved as Orpheus's are:
``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer files, so
transformers and vLLM load it through the code path of the real checkpoint.

``CODEBOOK_SIZE`` is tiny-snac's (:mod:`libs.models.tiny_snac`): the talker's audio vocabulary must
match the codec that decodes it. Outputs are meaningless; shapes, ids and timings are real.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from libs.models.hf_build import quiet_progress_bars, train_text_bpe
from libs.models.tiny_snac import CODEBOOK_SIZE

FRAME_SIZE = 7
"""Audio tokens per SNAC frame (1 of layer 0, 2 of layer 1, 4 of layer 2)."""
NUM_CONTROL_TOKENS = 10
"""``<custom_token_0>`` ... ``<custom_token_9>``: control tokens before the first audio token."""
NUM_CUSTOM_TOKENS = NUM_CONTROL_TOKENS + FRAME_SIZE * CODEBOOK_SIZE

MAX_MODEL_LEN = 2048
SEED = 4004

BEGIN_OF_TEXT, END_OF_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
LLAMA3_SPECIALS = (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    EOT,
)
"""Llama 3.2's special tokens 128000 ... 128009, in its order (Orpheus uses the first and last)."""


def custom_token(n: int) -> str:
    """The text of Orpheus's added token number ``n``."""
    return f"<custom_token_{n}>"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer: BPE text vocabulary, Llama 3 specials, then the custom tokens."""
    tok = train_text_bpe()
    text_size = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    # Orpheus adds its custom tokens as ordinary added tokens (``tokenizer.add_tokens``).
    tok.add_tokens([AddedToken(custom_token(n), normalized=False) for n in range(NUM_CUSTOM_TOKENS)])
    bos_id = tok.token_to_id(BEGIN_OF_TEXT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_OF_TEXT} $A",
        pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B:1",
        special_tokens=[(BEGIN_OF_TEXT, bos_id)],
    )
    if bos_id != text_size or tok.token_to_id(custom_token(0)) != text_size + len(LLAMA3_SPECIALS):
        raise RuntimeError("tiny-orpheus: special tokens did not land right after the text vocabulary")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BEGIN_OF_TEXT,
        eos_token=EOT,
        pad_token=custom_token(7),
        model_max_length=MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )


def _llama_config(tok: PreTrainedTokenizerFast) -> LlamaConfig:
    """Llama 3.2's architecture (rope scaling ``llama3``, tied embeddings) at a tiny size."""
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )


def build_tiny_orpheus(directory: Path) -> None:
    """Write tiny-orpheus into ``directory`` (existing, empty): tokenizer files, config.json,
    generation_config.json and fp32 ``model.safetensors``; the same bytes on every call."""
    tok = build_tokenizer()
    tok.save_pretrained(str(directory))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(_llama_config(tok))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    with quiet_progress_bars():
        model.save_pretrained(str(directory), safe_serialization=True)
