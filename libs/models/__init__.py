"""Self-generated tiny models (thinker, talker, code2wav) and the codec decoder runtime."""

from libs.models.codec import (
    CodecConfig,
    CodecDecoder,
    build_codec,
    decode_to_pcm16,
    load_codec,
    save_codec,
)
from libs.models.tiny import (
    TINY_MODELS,
    code_token,
    default_cache_dir,
    make_tiny,
    models_dir,
    read_talker_meta,
    resolve_model,
)

__all__ = [
    "TINY_MODELS",
    "CodecConfig",
    "CodecDecoder",
    "build_codec",
    "code_token",
    "decode_to_pcm16",
    "default_cache_dir",
    "load_codec",
    "make_tiny",
    "models_dir",
    "read_talker_meta",
    "resolve_model",
    "save_codec",
]
