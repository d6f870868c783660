"""Tiny code2wav decoder: codec codes -> mono 24 kHz PCM.

Each code is decoded on its own (no context across codes), so decoding a stream chunk by chunk
gives the same samples as decoding it in one piece (up to float rounding, at most 1 LSB).
Units: one code covers ``samples_per_code`` samples (480 samples = 20 ms at 24 kHz); waveforms
are float in [-1, 1]; PCM is little-endian signed 16-bit mono.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PEAK_AMPLITUDE = 0.5
"""Largest absolute output sample, as a fraction of full scale (keeps PCM clear of clipping)."""


@dataclass(frozen=True)
class CodecConfig:
    """Shape of the decoder. Rates in Hz, lengths in samples, sizes in features/channels."""

    num_codes: int = 1024
    samples_per_code: int = 480
    sample_rate: int = 24000
    channels: int = 1
    embed_dim: int = 64
    hidden_channels: int = 32
    coarse_upsample: int = 20
    """First upsampling factor; the second is ``samples_per_code // coarse_upsample``."""

    def __post_init__(self) -> None:
        if self.channels != 1:
            raise ValueError(f"only mono is supported, got channels={self.channels}")
        if self.samples_per_code % self.coarse_upsample:
            raise ValueError(
                f"samples_per_code={self.samples_per_code} is not a multiple of "
                f"coarse_upsample={self.coarse_upsample}"
            )

    @property
    def fine_upsample(self) -> int:
        """Second upsampling factor (samples per coarse step)."""
        return self.samples_per_code // self.coarse_upsample


class CodecDecoder(torch.nn.Module):
    """Codes [T] -> waveform [T * samples_per_code], float in [-PEAK_AMPLITUDE, PEAK_AMPLITUDE]."""

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.num_codes, cfg.embed_dim)
        self.coarse = torch.nn.ConvTranspose1d(
            cfg.embed_dim, cfg.hidden_channels, cfg.coarse_upsample, stride=cfg.coarse_upsample
        )
        self.fine = torch.nn.ConvTranspose1d(
            cfg.hidden_channels, 1, cfg.fine_upsample, stride=cfg.fine_upsample
        )
        self.register_buffer("gain", torch.ones(()))

    def pre_activation(self, codes: torch.Tensor) -> torch.Tensor:
        """Un-squashed output for codes [T] -> [T * samples_per_code]."""
        x = self.embed(codes).T.unsqueeze(0)  # [1, embed_dim, T]
        x = torch.nn.functional.gelu(self.coarse(x))
        return self.fine(x).reshape(-1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode codes (LongTensor [T]) to a float waveform [T * samples_per_code]."""
        return PEAK_AMPLITUDE * torch.tanh(self.gain * self.pre_activation(codes))

    @torch.inference_mode()
    def calibrate_gain(self) -> None:
        """Set ``gain`` so the pre-activation over all codes has unit RMS (audible, unclipped)."""
        rms = self.pre_activation(torch.arange(self.cfg.num_codes)).pow(2).mean().sqrt()
        self.gain.fill_(1.0 / max(float(rms), 1e-6))


def build_codec(cfg: CodecConfig, seed: int) -> CodecDecoder:
    """Create a randomly initialised, gain-calibrated decoder; same seed -> same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CodecDecoder(cfg)
    model.calibrate_gain()
    return model.eval()


def save_codec(model: CodecDecoder, cfg: CodecConfig, directory: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(cfg), indent=2, sort_keys=True) + "\n"
    (directory / CONFIG_FILE).write_text(text, encoding="utf-8")
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def load_codec(directory: Path | str) -> CodecDecoder:
    """Load a decoder saved by :func:`save_codec`, on CPU in eval mode."""
    directory = Path(directory)
    cfg = CodecConfig(**json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")))
    model = CodecDecoder(cfg)
    model.load_state_dict(load_file(str(directory / WEIGHTS_FILE), device="cpu"))
    return model.eval()


def validate_codes(codes: np.ndarray, num_codes: int) -> None:
    """Raise ValueError unless ``codes`` is a 1-D integer array with values in [0, num_codes)."""
    if codes.ndim != 1 or (codes.size and not np.issubdtype(codes.dtype, np.integer)):
        raise ValueError(f"codes must be a 1-D integer array, got {codes.dtype} {codes.shape}")
    if codes.size == 0:
        return
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= num_codes:
        bad = low if low < 0 else high
        raise ValueError(f"codec code {bad} is outside the valid range 0..{num_codes - 1}")


def decode_to_pcm16(model: CodecDecoder, codes: np.ndarray) -> bytes:
    """Decode codes to little-endian int16 mono PCM: ``len(codes) * samples_per_code * 2`` bytes."""
    codes = np.asarray(codes)
    validate_codes(codes, model.cfg.num_codes)
    if codes.size == 0:
        return b""
    with torch.inference_mode():
        wave = model(torch.from_numpy(codes.astype(np.int64, copy=False))).numpy()
    pcm = np.round(np.clip(wave, -1.0, 1.0) * 32767.0).astype("<i2")
    return pcm.tobytes()
