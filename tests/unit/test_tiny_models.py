"""Tiny model generation: determinism, reuse, concurrency, vocab layout, codec decoding."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from libs.models.codec import decode_to_pcm16, load_codec
from libs.models.tiny import (
    MARKER_FILE,
    TINY_MODELS,
    default_cache_dir,
    make_tiny,
    read_talker_meta,
    resolve_model,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One generated set shared by the read-only tests of this module."""
    return make_tiny(tmp_path_factory.mktemp("cache"))


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, keyed by relative path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_second_call_reuses_files(tiny: dict[str, Path]) -> None:
    """Every directory and file keeps its inode (nothing was replaced) and the modification time
    the test gave it, a day in the past (nothing was written: a write would set it to now)."""
    day_ago_ns = time.time_ns() - 86_400 * 10**9
    paths = [p for d in tiny.values() for p in (d, *d.iterdir())]
    for p in paths:
        os.utime(p, ns=(day_ago_ns, day_ago_ns))
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}
    assert make_tiny(tiny[TINY_MODELS[0]].parent.parent) == tiny
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths} == before


def test_force_rebuilds_and_corruption_is_repaired(tmp_path: Path) -> None:
    paths = make_tiny(tmp_path)
    config = paths["tiny-code2wav"] / "config.json"
    reference = config.read_bytes()
    config.write_text("{}")
    make_tiny(tmp_path)
    assert config.read_bytes() == reference
    mtime = config.stat().st_mtime_ns
    make_tiny(tmp_path, force=True)
    assert config.stat().st_mtime_ns != mtime and config.read_bytes() == reference
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir()) == sorted(TINY_MODELS)


def test_concurrent_generation_in_fresh_processes_is_byte_identical(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Three fresh processes (tokenizer training and seeding really run again: no in-process
    caches) generate the same directory at once; every file is the one this process made."""
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(make_tiny, [tmp_path] * 3)
    assert results[0] == results[1] == results[2]
    models = tmp_path / "models"
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == sorted(TINY_MODELS)
    for model_id in TINY_MODELS:
        assert file_hashes(models / model_id) == file_hashes(tiny[model_id]), model_id
        files = file_hashes(tiny[model_id])
        assert MARKER_FILE in files and {"model.safetensors", "pytorch_model.bin"} & files.keys()


def test_talker_vocab_extends_thinker(tiny: dict[str, Path]) -> None:
    thinker = AutoTokenizer.from_pretrained(str(tiny["tiny-thinker"]))
    talker = AutoTokenizer.from_pretrained(str(tiny["tiny-talker"]))
    meta = read_talker_meta(tiny["tiny-talker"])
    assert meta == {"text_vocab_size": len(thinker), "code_offset": len(thinker), "num_codes": 1024}
    assert len(talker) == len(thinker) + 1024
    text_vocab = thinker.get_vocab()
    assert {t: i for t, i in talker.get_vocab().items() if i < len(thinker)} == text_vocab
    codes = [f"<|code_{k}|>" for k in range(1024)]
    offset = meta["code_offset"]
    assert talker.convert_tokens_to_ids(codes) == list(range(offset, offset + 1024))
    assert talker.encode("<|code_7|>", add_special_tokens=False) == [offset + 7]


def test_chat_template(tiny: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny["tiny-thinker"]))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Will it rain at 5?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|bos|><|system|>Be brief.<|end|>")
    assert "<|user|>Will it rain at 5?<|end|>" in text
    assert text.endswith("<|assistant|>")
    closed = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("<|assistant|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids) == text


def test_codec_decode(tiny: dict[str, Path]) -> None:
    model = load_codec(tiny["tiny-code2wav"])
    codes = np.array([0, 1, 511, 1023, 42] * 4)
    pcm = decode_to_pcm16(model, codes)
    assert len(pcm) == len(codes) * 480 * 2
    assert decode_to_pcm16(load_codec(tiny["tiny-code2wav"]), codes) == pcm
    samples = np.frombuffer(pcm, dtype="<i2")
    assert 1000 < np.abs(samples).max() < 32767
    assert decode_to_pcm16(model, np.array([], dtype=np.int64)) == b""


def test_codec_decodes_faster_than_real_time(tiny: dict[str, Path]) -> None:
    """What streaming needs of code2wav: a chunk of codes decodes in less time than the audio it
    makes lasts (real-time factor below 1; its speed beyond that is for benchmarks). The fastest of
    ten decodes is judged: the others may have waited for a core on a shared machine."""
    model = load_codec(tiny["tiny-code2wav"])
    codes = np.arange(20) * 51 % 1024
    audio_s = len(decode_to_pcm16(model, codes)) / 2 / 24_000  # PCM16 mono at 24 kHz
    took = []
    for _ in range(10):
        start = time.perf_counter()
        decode_to_pcm16(model, codes)
        took.append(time.perf_counter() - start)
    assert audio_s == pytest.approx(20 * 480 / 24_000)
    assert min(took) < audio_s, f"fastest decode {min(took):.3f} s for {audio_s:.2f} s of audio"


@pytest.mark.parametrize("codes", [[1, 1024], [-1, 3], [[1, 2]]])
def test_codec_rejects_bad_codes(tiny: dict[str, Path], codes: list) -> None:
    with pytest.raises(ValueError, match="code"):
        decode_to_pcm16(load_codec(tiny["tiny-code2wav"]), np.array(codes))


def test_resolve_model(tiny: dict[str, Path], tmp_path: Path) -> None:
    assert resolve_model("/some/local/model") == "/some/local/model"
    assert resolve_model("org/some-hf-model", cache_dir=tmp_path) == "org/some-hf-model"
    assert not (tmp_path / "models").exists()
    cache = tiny["tiny-talker"].parent.parent
    assert resolve_model("tiny-talker", cache_dir=cache) == str(tiny["tiny-talker"])


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNIRELAY_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("OMNIRELAY_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "omnirelay"
