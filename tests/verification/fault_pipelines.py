"""The pipelines ``omnirelay verify faults`` can run (``--pipeline``, :data:`PIPELINES`) and the
faults of each: ``tiny`` (tiny thinker → tiny talker → tiny code2wav, :data:`~benchmarks.chat_streams.TWO_REPLICA_PIPELINE`),
``orpheus`` (tiny thinker → Orpheus talker on tiny-orpheus → SNAC on tiny-snac, built from
``compose/pipelines/orpheus-tiny.yaml``) and ``speech`` (a Whisper listener before the tiny chain,
served to realtime sessions). Each has two replicas of every stage, the same pipeline name
(:data:`PIPELINE_NAME`) and served model; ``tiny`` and ``orpheus`` have the same stage names
(:data:`STAGE_NAMES`), so every fault names its victim the same way in either.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.chat_streams import MODEL, TWO_REPLICA_PIPELINE
from tests.verification.fault_injection import FAULTS, PIPELINE_NAME, REPLICAS, STAGE_NAMES, Fault

ORPHEUS_TINY_YAML = Path(__file__).resolve().parents[2] / "compose" / "pipelines" / "orpheus-tiny.yaml"
ORPHEUS_STREAMS = 4
"""Audio streams of every Orpheus row."""
ORPHEUS_TOKENS = 200
"""Thinker tokens of each Orpheus stream: about 30 s of audio at the tiny talker's cap (0.5 frames
per character of the text), so the 4 streams keep two talker replicas busy for tens of seconds, and
the thinker, which makes tokens several times faster than the talkers make frames, busy for a few:
the thinker's rows strike in that window (their streams under way at the client and the thinker's
engine busy), the other rows while the talkers speak."""


def orpheus_pipeline_yaml() -> str:
    """``compose/pipelines/orpheus-tiny.yaml``'s speaking stages (its listener left out: the
    suite's rows are the chain's) with the suite's name and served model and two replicas of every
    stage; everything else (the talker protocol, its cap and voice, chunking,
    engine settings) as the file has it."""
    spec = yaml.safe_load(ORPHEUS_TINY_YAML.read_text(encoding="utf-8"))
    spec["name"], spec["served_model_name"] = PIPELINE_NAME, MODEL
    spec["stages"] = [stage for stage in spec["stages"] if stage["type"] != "asr"]  # the speaking stages
    for stage in spec["stages"]:
        stage["replicas"] = REPLICAS
    names = tuple(stage["name"] for stage in spec["stages"])
    if names != STAGE_NAMES:
        raise ValueError(f"{ORPHEUS_TINY_YAML}: stages {names}, the fault suite needs {STAGE_NAMES}")
    return yaml.safe_dump(spec, sort_keys=False)


def _audio(name: str, target: str, stage: int = 0, sig: int = signal.SIGKILL, hold_s: float = 0.0) -> Fault:
    """An Orpheus row: :data:`ORPHEUS_STREAMS` audio streams of :data:`ORPHEUS_TOKENS` tokens."""
    return Fault(
        name, target, stage, sig, hold_s, streams=ORPHEUS_STREAMS, audio=True, max_tokens=ORPHEUS_TOKENS
    )


THINKER, TALKER, CODE2WAV = 0, 1, 2
ORPHEUS_FAULTS = (
    _audio("kill -9 a thinker replica", "worker", THINKER),
    _audio("kill -9 a talker replica", "worker", TALKER),
    _audio("kill -9 a code2wav replica", "worker", CODE2WAV),
    _audio("kill -9 a thinker's EngineCore only", "engine_core", THINKER),
    _audio("kill -9 a talker's EngineCore only", "engine_core", TALKER),
    _audio("SIGSTOP a thinker replica 30 s", "worker", THINKER, signal.SIGSTOP, 30.0),
    _audio("SIGSTOP a talker replica 30 s", "worker", TALKER, signal.SIGSTOP, 30.0),
    _audio("SIGSTOP a talker's EngineCore 30 s (a hung engine)", "engine_core", TALKER, signal.SIGSTOP, 30.0),
    _audio("kill -9 every talker replica (down while their engines start)", "all_replicas", TALKER),
    # The strike waits for streams under way in the fault's stage: the talker, where an Orpheus
    # stream spends most of its time (the thinker is done with it within seconds).
    _audio("kill -9 the orchestrator", "orchestrator", TALKER),
    _audio("kill -9 nats-server, back 2 s later", "nats", TALKER),
)
"""The Orpheus rows. Not run: the two 3-node NATS cluster rows (they test the broker, which the
pipeline does not change, and cost a second stack of 6 workers)."""


@dataclass(frozen=True)
class FaultPipeline:
    """A pipeline the suite runs, and its faults."""

    name: str
    yaml: str
    faults: tuple[Fault, ...]
    judge_chunks: bool
    """Judge each completed audio stream's chunks against the whole decode of the code chunks
    the stages stream stored (:mod:`tests.verification.audio_accounting`), and the talker's input against
    the thinker's tokens."""

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The pipeline's stages by id."""
        return tuple(stage["name"] for stage in yaml.safe_load(self.yaml)["stages"])

    @property
    def codec_model(self) -> str:
        """The code2wav stage's model id (the whole-decode reference's codec)."""
        return yaml.safe_load(self.yaml)["stages"][-1]["model"]


SPEECH_PIPELINE_YAML = TWO_REPLICA_PIPELINE.replace(
    "stages:\n",
    "stages:\n  - {name: listener, type: asr, model: whisper-tiny-en, replicas: 2, consumes: audio,\n"
    "     emits: text, stream_to_client: true}\n",
)
"""The tiny pipeline behind a listener (Whisper tiny.en, the weights its package ships): the
realtime sessions' pipeline."""
LISTENER, SPEECH_TALKER = 0, 2


def _session(name: str, target: str, stage: int, max_tokens: int) -> Fault:
    """A ``speech`` row: 4 realtime sessions, each one spoken turn and one text turn."""
    return Fault(name, target, stage, streams=4, audio=True, max_tokens=max_tokens, session=True)


SPEECH_FAULTS = (
    _session("kill -9 a listener replica mid-utterance (realtime sessions)", "worker", LISTENER, 40),
    _session("kill -9 a talker replica mid-answer (realtime sessions)", "worker", SPEECH_TALKER, 160),
    _session("kill -9 the orchestrator mid-answer (realtime sessions)", "orchestrator", SPEECH_TALKER, 160),
)
"""The ``speech`` rows: a listener killed while it transcribes the callers' turns, a talker and
an orchestrator while the answers are spoken (answers of 160 tokens, about 13 s of audio)."""


def pipelines() -> dict[str, FaultPipeline]:
    """The suite's pipelines by ``--pipeline`` name."""
    return {
        "tiny": FaultPipeline("tiny", TWO_REPLICA_PIPELINE, FAULTS, judge_chunks=True),
        "orpheus": FaultPipeline("orpheus", orpheus_pipeline_yaml(), ORPHEUS_FAULTS, judge_chunks=True),
        "speech": FaultPipeline("speech", SPEECH_PIPELINE_YAML, SPEECH_FAULTS, judge_chunks=False),
    }


PIPELINES = ("tiny", "orpheus", "speech")
"""The ``--pipeline`` choices (:func:`pipelines`)."""
