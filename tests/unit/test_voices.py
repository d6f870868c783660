"""The voice resolver (libs/common/voices.py): every rule, and the client error's shape.

Expected voices come from outside the resolver: Orpheus's eight as the Orpheus TTS sources name
them, OpenAI's built-in names from the installed ``openai`` client's own types."""

from __future__ import annotations

import typing

import pytest
from openai.types.audio import speech_create_params
from openai.types.chat import chat_completion_audio_param

from libs.common.pipeline import DEFAULT_PIPELINE_PATH, TalkerConfig, load_pipeline
from libs.common.voices import OPENAI_VOICES, UnknownVoice, resolve_voice, talker_config

ORPHEUS = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
ORPHEUS_DEFAULT = TalkerConfig(protocol="orpheus")
ORPHEUS_LEO = TalkerConfig(protocol="orpheus", voice="leo")
TINY = TalkerConfig()


def _literal_names(alias: object) -> set[str]:
    """The string literals inside a typing alias such as ``Union[str, Literal[...], VoiceID]``."""
    names: set[str] = set()
    for arg in typing.get_args(alias):
        if typing.get_origin(arg) is typing.Literal:
            names.update(typing.get_args(arg))
    return names


def test_the_openai_names_are_those_of_the_openai_client() -> None:
    chat = _literal_names(chat_completion_audio_param.Voice)
    speech = _literal_names(speech_create_params.Voice)
    assert "alloy" in chat and "cedar" in speech
    assert set(OPENAI_VOICES) == chat | speech
    assert len(OPENAI_VOICES) == len(set(OPENAI_VOICES)) == 13
    assert not set(OPENAI_VOICES) & set(ORPHEUS)


@pytest.mark.parametrize("voice", ORPHEUS)
def test_a_voice_of_the_protocol_is_that_voice(voice: str) -> None:
    assert resolve_voice(ORPHEUS_DEFAULT, voice) == voice
    assert resolve_voice(ORPHEUS_LEO, voice) == voice


@pytest.mark.parametrize("voice", [*OPENAI_VOICES, None])
def test_an_openai_name_or_none_is_the_stage_default(voice: str | None) -> None:
    assert resolve_voice(ORPHEUS_DEFAULT, voice) == "tara"  # the protocol's first
    assert resolve_voice(ORPHEUS_LEO, voice) == "leo"  # the YAML's talker.voice


@pytest.mark.parametrize("voice", ["alloy", "leo", "no-such-voice", "", None])
def test_a_protocol_without_voices_takes_none_whatever_was_asked(voice: str | None) -> None:
    assert resolve_voice(TINY, voice) is None


def test_a_pipeline_without_a_talker_takes_none() -> None:
    text_only = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("text-only.yaml"))
    assert talker_config(text_only) is None
    assert resolve_voice(talker_config(text_only), "no-such-voice") is None


def test_the_talker_config_is_the_stage_emitting_codec_codes() -> None:
    orpheus = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("orpheus-tiny.yaml"))
    (talker,) = [s for s in orpheus.stages if s.emits.value == "codec_codes"]
    assert talker_config(orpheus) is talker.talker and talker.talker.protocol.value == "orpheus"
    assert talker_config(load_pipeline()).protocol.value == "tiny"


@pytest.mark.parametrize("voice", ["Leo", "TARA", "tara ", "voice_1234", "", "default"])
def test_anything_else_is_a_400_invalid_value_listing_the_voices(voice: str) -> None:
    with pytest.raises(UnknownVoice) as e:
        resolve_voice(ORPHEUS_LEO, voice, param="audio.voice")
    err = e.value
    assert (err.status, err.code, err.param, err.voice) == (400, "invalid_value", "audio.voice", voice)
    assert err.voices == ORPHEUS
    message = str(err)
    assert message.startswith(f"audio.voice {voice!r} ")
    assert all(v in message for v in ORPHEUS) and "leo" in message.split("default voice")[1]
    with pytest.raises(UnknownVoice) as e:
        resolve_voice(ORPHEUS_DEFAULT, voice)
    assert e.value.param == "voice" and str(e.value).startswith(f"voice {voice!r} ")
