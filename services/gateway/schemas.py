"""Request and response bodies of the OpenAI-compatible API (the subset omnirelay serves).

Unknown request fields are ignored, as OpenAI-compatible servers commonly do; fields whose
meaning we cannot honour (tools, n > 1, non-text input parts, ...) are rejected with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.audio import AudioFormat
from services.gateway.audio_tempo import MAX_SPEED, MIN_SPEED


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputAudio(BaseModel):
    """OpenAI's ``input_audio`` content part: base64 of an audio file (any FFmpeg reads is taken)."""

    data: str
    format: Literal["wav", "mp3"]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    input_audio: InputAudio | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class VoiceRef(BaseModel):
    """OpenAI's custom-voice object, ``{"id": ...}``: the id is looked up as a voice name."""

    id: str


class AudioParams(BaseModel):
    voice: str | VoiceRef | None = None
    """A voice of the pipeline's talker, one of OpenAI's built-in names (the talker's default
    voice), or none (the same); resolved by :func:`libs.common.voices.resolve_voice`."""
    format: str = "wav"

    @property
    def voice_name(self) -> str | None:
        """The asked voice as a name (a custom-voice object's id)."""
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_Request):
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    """A signed 64-bit integer, as vLLM's own server takes it (a larger one cannot be encoded)."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    """vLLM extension: keep generating past the end-of-sequence token."""
    return_token_ids: bool = False
    """vLLM extension: include the generated token ids in each choice/delta."""


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    modalities: list[str] | None = None
    audio: AudioParams | None = None


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[str]
    echo: bool = False


MAX_SPEECH_INPUT_CHARS = 4096
"""OpenAI's limit on ``input`` of ``/v1/audio/speech``, characters."""


class SpeechRequest(_Request):
    """OpenAI's ``POST /v1/audio/speech`` body."""

    model: str
    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT_CHARS)
    voice: str | VoiceRef
    """As ``audio.voice`` of chat completions (:class:`AudioParams`)."""
    response_format: AudioFormat = AudioFormat.MP3
    """OpenAI's list (``pcm``: 24 kHz 16-bit mono, no header)."""
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    """Playback speed, pitch kept (1.0: as spoken)."""
    instructions: str | None = None
    """Accepted and not used: no talker protocol here takes spoken instructions."""
    stream_format: Literal["audio", "sse"] = "audio"
    """``audio``: the file's bytes, streamed as they are encoded; ``sse``: ``speech.audio.delta``
    events (base64 bytes of the file), then ``speech.audio.done`` with ``usage``."""

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class VoiceCard(BaseModel):
    id: str
    object: Literal["voice"] = "voice"
    default: bool = False
    """The voice the talker speaks when none is asked (and for OpenAI's built-in names)."""


class VoiceList(BaseModel):
    """``GET /v1/audio/voices``: the voices of the pipeline's talker (none for a talker with one
    sound, such as ``tiny``, which takes any voice), and OpenAI's built-in names, each of which
    speaks in the default voice."""

    object: Literal["list"] = "list"
    data: list[VoiceCard]
    openai_names: list[str]


class SpeechUsage(BaseModel):
    """``usage`` of ``speech.audio.done``: ``input_tokens`` the input's tokens (the thinker's
    tokenizer), ``output_tokens`` the PCM samples' codec frames the talker made them from."""

    input_tokens: int
    output_tokens: int
    total_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AudioOut(BaseModel):
    """OpenAI's ``message.audio`` / ``delta.audio``."""

    id: str
    data: str | None = None
    expires_at: int | None = None
    transcript: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    audio: AudioOut | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: AudioOut | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnirelay"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    """``ok`` and ``degraded`` answer 200, ``unavailable`` 503."""
    bus: bool
    orchestrators: int
    stages: dict[str, int]
    """Live replicas per stage, keyed ``<id>:<name>``."""
    degraded: list[str] = Field(default_factory=list)
    """Stages (``<id>:<name>``) with fewer live replicas than the pipeline declares."""
    detail: dict[str, Any] = Field(default_factory=dict)


# --- transcriptions -----------------------------------------------------------------------------
MAX_TRANSCRIPTION_PROMPT_CHARS = 2000
"""Longest ``prompt`` of a transcription, characters (Whisper reads its last 224 tokens)."""


class TranscriptionForm(_Request):
    """OpenAI's ``POST /v1/audio/transcriptions`` form fields (the ``file`` part aside)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, arbitrary_types_allowed=True)
    file: UploadFile
    model: str
    language: str | None = Field(default=None, pattern=r"^[a-z]{2,3}$")
    """The spoken language, ISO 639-1 (none: the listener's default, or detected)."""
    prompt: str = Field(default="", max_length=MAX_TRANSCRIPTION_PROMPT_CHARS)
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: float = Field(default=0.0, ge=0, le=1)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(
        default_factory=list, alias="timestamp_granularities[]"
    )
    stream: bool = False
    """``transcript.text.delta`` events, one per segment, then ``transcript.text.done``."""


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class TokenUsage(BaseModel):
    """A streamed transcription's usage: the audio's tokens (Whisper's encoder positions, 50 per
    second) in, the transcript's tokens out."""

    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class Transcription(BaseModel):
    text: str
    usage: DurationUsage


class TranscriptionVerbose(BaseModel):
    task: Literal["transcribe"] = "transcribe"
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: DurationUsage


class TranscriptDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TokenUsage
