"""Pipeline configuration: the YAML file that names the stages, their models and how they chain.

Stage ids are the 0-based position in ``stages``. Invalid files fail at load time with a message
that names the file, the field and the reason.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_PIPELINE_PATH = Path(__file__).resolve().parents[2] / "compose" / "pipelines" / "default.yaml"

_NAME_RE = r"^[a-z][a-z0-9_-]*$"


class StageType(StrEnum):
    """What runs inside a stage worker."""

    LLM = "llm"
    CODEC = "codec"
    ASR = "asr"
    """A listener: speech recognition (faster-whisper), audio in, text out."""


class Payload(StrEnum):
    """What a stage consumes or emits."""

    TEXT = "text"
    CODEC_CODES = "codec_codes"
    AUDIO = "audio"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Chunking(_Strict):
    """When a stage forwards a chunk downstream: every ``tokens`` text tokens (or at a sentence's
    end with ``sentence_end``); every ``codes`` codec codes (``orpheus``: frames at most)."""

    tokens: int = Field(default=16, ge=1, le=4096)
    sentence_end: bool = True
    codes: int = Field(default=25, ge=1, le=100_000)


class TalkerProtocolName(StrEnum):
    """How a talker turns text chunks into codec codes (``services/stage_worker/talkers``)."""

    TINY = "tiny"
    ORPHEUS = "orpheus"


TALKER_VOICES: dict[TalkerProtocolName, tuple[str, ...]] = {
    TalkerProtocolName.TINY: (),
    TalkerProtocolName.ORPHEUS: ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"),
}
"""The voices each protocol knows (the first is its default); ``tiny`` takes none."""


class TalkerSampling(_Strict):
    """Sampling overrides of a talker; unset fields keep the protocol's defaults."""

    temperature: float | None = Field(default=None, ge=0, le=10)
    top_p: float | None = Field(default=None, gt=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)


class TalkerConfig(_Strict):
    """The talker protocol of an ``llm`` stage that emits ``codec_codes``."""

    protocol: TalkerProtocolName = TalkerProtocolName.TINY
    voice: str | None = Field(default=None, description="the stage's default voice (a protocol's)")
    sampling: TalkerSampling = TalkerSampling()
    max_frames_per_char: float = Field(default=2.0, gt=0, le=100, description="orpheus: frames cap per char")
    min_frames: int = Field(default=12, ge=1, le=100_000, description="orpheus: the cap's minimum")

    @model_validator(mode="after")
    def _check_voice(self) -> TalkerConfig:
        voices = TALKER_VOICES[self.protocol]
        if self.voice is not None and self.voice not in voices:
            known = ", ".join(voices) if voices else "none"
            raise ValueError(
                f"voice '{self.voice}' is not a voice of protocol '{self.protocol.value}' ({known})"
            )
        return self


class MockEngineConfig(_Strict):
    """A fake engine in place of vLLM for a thinker stage (:mod:`services.stage_worker.mock_engine`)."""

    inter_token_ms: float = Field(default=0.0, ge=0, le=10_000, description="time between two tokens, ms")


class ListenerConfig(_Strict):
    """How an ``asr`` stage runs faster-whisper (a CTranslate2 Whisper model directory)."""

    device: str = Field(default="cpu", pattern=r"^(cpu|cuda|auto)$", description="CTranslate2's device")
    compute_type: str = Field(default="int8", min_length=1, description="CTranslate2's compute type")
    cpu_threads: int = Field(default=1, ge=1, le=256, description="threads of one transcription on CPU")
    beam_size: int = Field(default=1, ge=1, le=16, description="1: greedy decoding, the fastest")
    language: str | None = Field(
        default="en", pattern=r"^[a-z]{2,3}$", description="ISO 639-1 default of requests; null: detected"
    )


class EngineArgs(_Strict):
    """Engine settings for ``llm`` stages (passed to vLLM's ``AsyncEngineArgs``)."""

    max_model_len: int = Field(default=2048, ge=16)
    max_num_seqs: int = Field(default=64, ge=1)
    enforce_eager: bool = True
    dtype: str = "auto"
    kv_cache_space_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE (CPU builds), GiB")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    busy_spin_ms: float = Field(default=5.0, ge=0, le=1000, description="queue busy-wait, ms (vLLM's: 1000)")
    busy_nap_ms: float = Field(default=0.2, gt=0, le=100, description="then poll period (1 s window), ms")
    extra: dict[str, object] = Field(default_factory=dict, description="any other AsyncEngineArgs field")
    mock: MockEngineConfig | None = Field(default=None, description="a fake engine in place of vLLM")


class StageConfig(_Strict):
    """One stage of the chain."""

    name: str = Field(pattern=_NAME_RE)
    type: StageType
    model: str = Field(min_length=1)
    replicas: int = Field(default=1, ge=1, le=64)
    consumes: Payload
    emits: Payload
    stream_to_client: bool = False
    chunking: Chunking = Chunking()
    codes_per_token: int = Field(default=4, ge=1, le=64, description="talker: codes per input text token")
    talker: TalkerConfig = Field(default=TalkerConfig(), description="talkers: protocol, voice, sampling")
    engine: EngineArgs = EngineArgs()
    listener: ListenerConfig = Field(default=ListenerConfig(), description="asr stages: faster-whisper")
    stall_timeout_s: float = Field(default=10.0, gt=0, le=600, description="busy replica probe timeout, s")
    migration_limit: int = Field(default=3, ge=0, le=100, description="moves of a request within the stage")
    no_replica_wait_s: float = Field(default=2.0, ge=0, le=600, description="wait for a live replica, s")


class PipelineConfig(_Strict):
    """A whole pipeline as loaded from YAML."""

    name: str = Field(pattern=_NAME_RE, max_length=32)
    served_model_name: str = Field(min_length=1)
    request_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    stages: list[StageConfig] = Field(min_length=1)
    source: str = Field(default="<memory>", exclude=True)

    @model_validator(mode="after")
    def _check_chain(self) -> PipelineConfig:
        t = self.thinker_stage
        if t == len(self.stages):
            raise ValueError("stages[0] is a listener ('asr'): a thinker must come after it")
        head = self.stages[t]
        if head.type != StageType.LLM or head.consumes != Payload.TEXT or head.emits != Payload.TEXT:
            raise ValueError(
                f"stages[{t}] must be an 'llm' stage consuming and emitting 'text' (the thinker), "
                "after an optional 'asr' stage (the listener)"
            )
        for i in range(1, len(self.stages)):
            prev, cur = self.stages[i - 1], self.stages[i]
            if cur.consumes != prev.emits:
                raise ValueError(
                    f"stages[{i}].consumes is '{cur.consumes.value}' but stages[{i - 1}] "
                    f"('{prev.name}') emits '{prev.emits.value}'"
                )
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, s in enumerate(self.stages):
            _check_stage(i, s, self.stages[i + 1] if i + 1 < len(self.stages) else None)
        return self

    @property
    def audio_stage(self) -> int | None:
        """Id of the stage that emits audio, or None for a text-only pipeline."""
        return next((i for i, s in enumerate(self.stages) if s.emits == Payload.AUDIO), None)

    @property
    def speech_stage(self) -> int | None:
        """Id of the talker (the ``llm`` stage that emits codec codes), or None."""
        return next((i for i, s in enumerate(self.stages) if _is_talker(s)), None)

    @property
    def listener_stage(self) -> int | None:
        """Id of the listener (the ``asr`` stage, always the first), or None."""
        return 0 if self.stages[0].type == StageType.ASR else None

    @property
    def thinker_stage(self) -> int:
        """Id of the thinker (the first stage after the listener, if any)."""
        return 1 if self.stages[0].type == StageType.ASR else 0

    @property
    def thinker(self) -> StageConfig:
        return self.stages[self.thinker_stage]

    def takes_start(self, stage: int) -> bool:
        """Whether ``stage`` takes ``start`` tasks from the orchestrator rather than chunks."""
        return stage in (self.listener_stage, self.thinker_stage)

    def upstream(self, stage: int) -> int | None:
        """The stage whose chunks ``stage`` takes, or None for a stage that takes ``start`` tasks."""
        return None if self.takes_start(stage) else stage - 1

    def too_far(self, deadline_ns: int, now_ns: int) -> bool:
        """Whether ``deadline_ns`` lies beyond ``request_timeout_s`` + 5 s from now: a forged deadline."""
        return deadline_ns > now_ns + int((self.request_timeout_s + 5) * 1e9)

    def declares(self, stage: int, replica: int) -> bool:
        return 0 <= stage < len(self.stages) and 0 <= replica < self.stages[stage].replicas

    def stages_for(self, audio: bool, entry: int) -> list[int]:
        """Stage ids a request entering at ``entry`` runs through."""
        if entry == self.listener_stage or not audio:
            return [entry]
        return list(range(entry, len(self.stages)))


def _is_talker(s: StageConfig) -> bool:
    return s.type == StageType.LLM and s.emits == Payload.CODEC_CODES


def _check_stage(i: int, s: StageConfig, after: StageConfig | None) -> None:
    is_talker = _is_talker(s)
    if "talker" in s.model_fields_set and not is_talker:
        raise ValueError(f"stages[{i}].talker: only an llm stage that emits codec_codes has a talker")
    if "listener" in s.model_fields_set and s.type != StageType.ASR:
        raise ValueError(f"stages[{i}].listener: only an asr stage has listener settings")
    if s.engine.mock is not None and not (s.type == StageType.LLM and s.emits == Payload.TEXT):
        raise ValueError(
            f"stages[{i}].engine.mock: only an llm stage that emits text runs on the mock engine"
        )
    has_codec_next = after is not None and after.type == StageType.CODEC
    if is_talker and s.talker.protocol != TalkerProtocolName.TINY and not has_codec_next:
        raise ValueError(
            f"stages[{i}].talker.protocol '{s.talker.protocol.value}' reads its codebook size "
            f"from the codec stage after it, and stages[{i + 1}] is not one"
        )
    if s.type == StageType.CODEC and (s.consumes, s.emits) != (Payload.CODEC_CODES, Payload.AUDIO):
        raise ValueError(f"stages[{i}] ('{s.name}'): a codec stage maps codec_codes → audio")
    if s.type == StageType.ASR and ((s.consumes, s.emits) != (Payload.AUDIO, Payload.TEXT) or i != 0):
        raise ValueError(
            f"stages[{i}] ('{s.name}'): an asr stage (the listener) maps audio → text and comes first"
        )


class PipelineConfigError(ValueError):
    """A pipeline file that cannot be used."""


def load_pipeline(path: str | Path | None = None) -> PipelineConfig:
    """Load and validate a pipeline YAML file (the shipped default when ``path`` is None)."""
    p = Path(path) if path else DEFAULT_PIPELINE_PATH
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise PipelineConfigError(f"{p}: cannot read pipeline file: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise PipelineConfigError(f"{p}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise PipelineConfigError(f"{p}: top level must be a mapping, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate({**raw, "source": str(p)})
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(x) for x in err['loc']) or '<root>'}': {err['msg']}" for err in e.errors()
        )
        raise PipelineConfigError(f"{p}: invalid pipeline: {problems}") from None
