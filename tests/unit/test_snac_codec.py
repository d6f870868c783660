"""tiny-snac and the ``snac`` codec adapter: the real 24 kHz structure, Orpheus's frame layout, and
streamed decoding that gives the samples of a whole-utterance decode (noise on)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from snac import SNAC
from snac.layers import NoiseBlock

from libs.models.tiny_snac import CODEBOOK_SIZE, build_tiny_snac
from services.stage_worker.codecs.base import CodeChunk
from services.stage_worker.codecs.snac import SnacCodecAdapter, frames_to_layers

SAMPLES_PER_FRAME = 2048
"""SNAC 24 kHz: one layer-0 code covers 4 hops of 512 samples."""

SNAC_24KHZ = {
    "sampling_rate": 24000,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
"""Every field of hubertsiuzdak/snac_24khz's config.json except the widths (encoder_dim 48,
decoder_dim 1024) and codebook_size (4096), written out from the published file."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decode with one intra-op thread, as the code2wav worker does: with two, how torch splits a
    batch's work between them changes float32 sums (a batched chunk then differs from the same
    chunk alone by up to 1 PCM16 step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-snac")
    build_tiny_snac(directory)
    return directory


@pytest.fixture(scope="module")
def adapter(snac_dir: Path) -> SnacCodecAdapter:
    return SnacCodecAdapter.load(snac_dir)


@pytest.fixture(scope="module")
def adapter64(snac_dir: Path) -> SnacCodecAdapter:
    """The same checkpoint computed in float64: whole and streamed decodes then differ by ~1e-15,
    far below half a PCM16 step, so any difference left would be the chunking's own."""
    return SnacCodecAdapter(SNAC.from_pretrained(str(snac_dir)).double())


def random_frames(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (frames, 7)).astype(np.int32)


def test_tiny_snac_loads_offline_with_the_24khz_structure(snac_dir: Path, monkeypatch) -> None:
    def no_network(*args, **kwargs):
        raise AssertionError("from_pretrained of a local directory reached for the network")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert sorted(p.name for p in snac_dir.iterdir()) == ["config.json", "pytorch_model.bin"]
    config = json.loads((snac_dir / "config.json").read_text())
    assert {k: config[k] for k in SNAC_24KHZ} == SNAC_24KHZ
    assert config["codebook_size"] == CODEBOOK_SIZE == 256
    model = SNAC.from_pretrained(str(snac_dir))  # load_state_dict is strict: every weight is there
    assert model.hop_length == 512 and not model.training
    assert sum(isinstance(m, NoiseBlock) for m in model.modules()) == 4
    audio = torch.zeros(1, 1, 5 * SAMPLES_PER_FRAME)
    with torch.inference_mode():
        codes = model.encode(audio)
        assert [c.shape[-1] for c in codes] == [5, 10, 20]  # 11.7, 23.4, 46.9 Hz
        assert model.decode(codes).shape[-1] == 5 * SAMPLES_PER_FRAME


def orpheus_frames(l0: np.ndarray, l1: np.ndarray, l2: np.ndarray) -> np.ndarray:
    """Orpheus TTS's data preparation, which turns SNAC's three layers into 7 tokens per frame
    (token = code + 128266 + position · 4096 there; only the codes are kept here): frame i is
    l0[i], l1[2i], l2[4i], l2[4i+1], l1[2i+1], l2[4i+2], l2[4i+3]."""
    tokens = []
    for i in range(len(l0)):
        tokens += [l0[i], l1[2 * i], l2[4 * i], l2[4 * i + 1], l1[2 * i + 1], l2[4 * i + 2], l2[4 * i + 3]]
    return np.asarray(tokens).reshape(-1, 7)


def test_frames_to_layers_inverts_orpheus_data_preparation() -> None:
    rng = np.random.default_rng(7)
    for frames in (1, 2, 13):
        layers = [rng.integers(0, 4096, frames * n) for n in (1, 2, 4)]
        got = frames_to_layers(orpheus_frames(*layers))
        assert [g.tolist() for g in got] == [x.tolist() for x in layers]
    batch = np.stack([orpheus_frames(*[rng.integers(0, 4096, 3 * n) for n in (1, 2, 4)]) for _ in range(2)])
    for b in range(2):
        assert all(
            np.array_equal(whole[b], one)
            for whole, one in zip(frames_to_layers(batch), frames_to_layers(batch[b]), strict=True)
        )


def _silence_noise(model: SNAC) -> SNAC:
    """Zero the gain of every noise block's projection (weight norm's magnitude), so the noise adds 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".linear.parametrizations.weight.original0" in name:
                p.zero_()
    return model


def test_adapter_feeds_snac_the_layers_in_orpheus_order(snac_dir: Path) -> None:
    """With the noise silenced in both, the adapter's decode of Orpheus frames is SNAC's own
    decode of the layers they were made from."""
    rng = np.random.default_rng(3)
    layers = [rng.integers(0, CODEBOOK_SIZE, 9 * n) for n in (1, 2, 4)]
    raw = _silence_noise(SNAC.from_pretrained(str(snac_dir)))
    with torch.inference_mode():
        wave = raw.decode([torch.from_numpy(x).unsqueeze(0) for x in layers])[0, 0].double().numpy()
    expected = np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16)
    adapter = SnacCodecAdapter(_silence_noise(SNAC.from_pretrained(str(snac_dir))))
    got = adapter.decode(orpheus_frames(*layers), first_frame=0)
    assert got.dtype == np.dtype("<i2") and np.array_equal(got, expected)
    assert np.abs(expected).max() > 1000  # the signal is not silence


def random_chunking(frames: int, max_chunk: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(start, end) frame ranges of sizes 1..max_chunk covering 0..frames."""
    bounds, at = [], 0
    while at < frames:
        size = int(rng.integers(1, max_chunk + 1))
        bounds.append((at, min(frames, at + size)))
        at += size
    return bounds


def streamed(
    adapter: SnacCodecAdapter, codes: np.ndarray, bounds, context: tuple[int, int]
) -> list[np.ndarray]:
    """Each chunk decoded alone as code2wav gets it: its own frames plus up to ``context`` frames
    of its neighbours (fewer at the utterance's edges)."""
    out = []
    for start, end in bounds:
        lo, hi = max(0, start - context[0]), min(len(codes), end + context[1])
        out.append(adapter.decode(codes[lo:hi], first_frame=start, before=start - lo, after=hi - end))
    return out


FRAMES = 24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_decode_is_the_whole_decode(
    adapter: SnacCodecAdapter, adapter64: SnacCodecAdapter, seed: int
) -> None:
    """Random chunkings (1..FRAMES frames per chunk) with the adapter's contexts give the whole
    utterance's samples. In float64 exactly. In float32 (what serves) within 1 PCM16 step: the
    convolutions' float32 sums are ordered by the input's length, so a sample can move by ~1e-6 of
    full scale (1/50 of a step) and, rarely, land on the other side of a rounding boundary."""
    rng = np.random.default_rng(100 + seed)
    codes = random_frames(FRAMES, seed)
    bounds = random_chunking(FRAMES, int(rng.integers(1, FRAMES + 1)), rng)
    assert adapter.context == adapter64.context == (3, 3)

    whole64 = adapter64.decode(codes, first_frame=0)
    parts64 = streamed(adapter64, codes, bounds, adapter64.context)
    assert [len(p) for p in parts64] == [(e - s) * SAMPLES_PER_FRAME for s, e in bounds]
    assert np.array_equal(np.concatenate(parts64), whole64)

    whole = adapter.decode(codes, first_frame=0)
    parts = np.concatenate(streamed(adapter, codes, bounds, adapter.context))
    diff = np.abs(parts.astype(np.int32) - whole)
    assert len(whole) == FRAMES * SAMPLES_PER_FRAME and diff.max() <= 1 and diff.mean() < 0.01
    assert np.abs(whole.astype(np.int32) - whole64).max() <= 1


def test_two_frames_of_context_are_not_enough(adapter64: SnacCodecAdapter) -> None:
    """The same check with 2 frames each side fails: 3 is what the decoder's reach needs."""
    codes = random_frames(FRAMES, 5)
    bounds = [(s, s + 4) for s in range(0, FRAMES, 4)]
    whole = adapter64.decode(codes, first_frame=0)
    diff = np.abs(np.concatenate(streamed(adapter64, codes, bounds, (2, 2))).astype(np.int32) - whole)
    assert diff.max() > 1


def test_noise_is_on_and_a_function_of_the_frame(snac_dir: Path, adapter: SnacCodecAdapter) -> None:
    """The package's decoder draws fresh noise on every call; the adapter's is the same for a frame
    wherever it is decoded: a chunk redone on another replica (a new adapter) gives the same
    bytes, the same codes at another position give other samples."""
    codes = random_frames(8, 9)
    raw = SNAC.from_pretrained(str(snac_dir))
    layers = [torch.from_numpy(x).long().unsqueeze(0) for x in frames_to_layers(codes)]
    with torch.inference_mode():
        assert not torch.equal(raw.decode(layers), raw.decode(layers))
    first = adapter.decode(codes, first_frame=10, before=2, after=1)
    redone = SnacCodecAdapter.load(snac_dir).decode(codes, first_frame=10, before=2, after=1)
    assert first.tobytes() == redone.tobytes()
    moved = adapter.decode(codes, first_frame=11, before=2, after=1)
    assert not np.array_equal(first, moved)
    silent = SnacCodecAdapter(_silence_noise(SNAC.from_pretrained(str(snac_dir))))
    assert not np.array_equal(first, silent.decode(codes, first_frame=10, before=2, after=1))


@pytest.mark.parametrize("position", range(7))
@pytest.mark.parametrize("value", [-1, CODEBOOK_SIZE])
def test_out_of_range_codes_are_rejected_naming_frame_and_position(
    adapter: SnacCodecAdapter, position: int, value: int
) -> None:
    codes = random_frames(6, 4)
    codes[4, position] = value
    with pytest.raises(ValueError, match=rf"code {value} at frame 13 position {position} .*0\.\.255"):
        adapter.decode(codes, first_frame=10, before=1)


@pytest.mark.parametrize(
    ("shape", "before", "after"), [((5,), 0, 0), ((5, 6), 0, 0), ((5, 7), 3, 3), ((5, 7), 6, 0)]
)
def test_malformed_chunks_are_rejected(adapter: SnacCodecAdapter, shape, before: int, after: int) -> None:
    with pytest.raises(ValueError):
        adapter.decode(np.zeros(shape, dtype=np.int32), first_frame=10, before=before, after=after)


def test_context_before_the_first_frame_is_rejected(adapter: SnacCodecAdapter) -> None:
    with pytest.raises(ValueError, match="before frame 0"):
        adapter.decode(random_frames(5, 1), first_frame=1, before=2)


def test_batched_decode_is_each_chunk_decoded_alone(adapter: SnacCodecAdapter) -> None:
    """Chunks of several requests (equal and unequal lengths, one empty) in one call give what each
    gives alone, byte for byte: a chunk redone alone after a move matches its batched first run."""
    rng = np.random.default_rng(11)
    chunks = [
        CodeChunk(random_frames(10, 20), 3, 3, 3),
        CodeChunk(random_frames(10, 21), 40, 3, 3),
        CodeChunk(random_frames(7, 22), 0, 0, 3),
        CodeChunk(random_frames(3, 23), 3, 3, 0),
        CodeChunk(np.zeros((0, 7), dtype=np.int32), 9),
        CodeChunk(random_frames(10, int(rng.integers(100))), 17, 3, 3),
    ]
    together = adapter.decode_batch(chunks)
    alone = [adapter.decode(c.codes, c.first_frame, c.before, c.after) for c in chunks]
    assert [len(t) for t in together] == [c.own_frames * SAMPLES_PER_FRAME for c in chunks]
    assert all(t.tobytes() == a.tobytes() for t, a in zip(together, alone, strict=True))
