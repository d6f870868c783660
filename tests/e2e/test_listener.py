"""The listener stage with its real Whisper model (tiny.en from the installed package) behind a real
gateway, orchestrator and nats-server, called with the official ``openai`` client on real speech
(espeak-ng): ``/v1/audio/transcriptions`` in every response format and streamed, the transcript
against the words spoken and the durations against the WAV files' own, the listener's metrics
against what the test sent, and bad audio answered with a 400 in OpenAI's shape."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.models.tiny import resolve_model
from tests.pipeline_services import Services
from tests.procs import LISTENER_YAML, mock_thinker_yaml, write_pipeline
from tests.speech import padded, recall, silence_wav, spoken, wav_seconds

pytestmark = pytest.mark.e2e

PIPELINE = "listen"
LISTENER_THINKER_YAML = LISTENER_YAML + mock_thinker_yaml()
SAID = "Hello world. This is a test of the speech pipeline."
MIN_RECALL = 0.7
"""Share of the spoken words the transcript must hold: Whisper tiny.en on espeak-ng's voice
mishears a word or two in ten ("a test of" → "my test on")."""


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real listener, a mock thinker, a real orchestrator and gateway."""
    tmp = tmp_path_factory.mktemp("listen")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, LISTENER_THINKER_YAML)
    with Services(nats_server.url, path, tmp).start(workers=[(0, 0), (1, 0)]).serving() as services:
        yield services


@pytest.fixture(scope="module")
def client(stack: Services) -> openai.OpenAI:
    """The official client, synchronous (these tests are)."""
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> bytes:
    """espeak-ng saying :data:`SAID`, with half a second of silence either side."""
    wav = spoken(SAID, tmp_path_factory.mktemp("speech") / "said.wav").read_bytes()
    return padded(wav, 0.5, 0.5)


def _file(data: bytes) -> tuple[str, io.BytesIO, str]:
    return ("said.wav", io.BytesIO(data), "audio/wav")


def _listened(stack: Services) -> tuple[float, float, float]:
    """(input-audio seconds summed, transcriptions counted, RTF observations counted) on the
    listener's ``/metrics``."""
    text = httpx.get(stack.worker(0).metrics_url, timeout=5).text
    found = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            found[s.name] = found.get(s.name, 0.0) + s.value
    return (
        found.get("vllm:omni_input_audio_duration_s_sum", 0.0),
        found.get("vllm:omni_input_audio_duration_s_count", 0.0),
        found.get("vllm:omni_asr_rtf_count", 0.0),
    )


def test_a_sentence_is_transcribed_in_every_format(client, stack, sentence) -> None:
    before = _listened(stack)
    plain = client.audio.transcriptions.create(model=stack.model, file=_file(sentence))
    assert recall(plain.text, SAID) >= MIN_RECALL, plain.text
    assert plain.usage.type == "duration"
    assert plain.usage.seconds == pytest.approx(wav_seconds(sentence), abs=0.01)

    verbose = client.audio.transcriptions.create(
        model=stack.model, file=_file(sentence), response_format="verbose_json"
    )
    assert verbose.text == plain.text, "greedy decoding at temperature 0 hears the same twice"
    assert verbose.language == "english"
    assert verbose.duration == pytest.approx(wav_seconds(sentence), abs=0.01)
    assert verbose.segments and "".join(s.text for s in verbose.segments).strip() == verbose.text
    for seg in verbose.segments:
        assert 0 <= seg.start < seg.end <= verbose.duration + 0.05, seg
        assert seg.tokens

    text = client.audio.transcriptions.create(model=stack.model, file=_file(sentence), response_format="text")
    assert text.strip() == plain.text
    srt = client.audio.transcriptions.create(model=stack.model, file=_file(sentence), response_format="srt")
    assert srt.startswith("1\n00:00:") and " --> " in srt
    vtt = client.audio.transcriptions.create(model=stack.model, file=_file(sentence), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:")

    # The listener counted each of the five, with the audio's seconds as the WAV file has them.
    after = _listened(stack)
    assert after[1] - before[1] == 5 and after[2] - before[2] == 5
    assert after[0] - before[0] == pytest.approx(5 * wav_seconds(sentence), abs=0.01)


def test_a_streamed_transcript_adds_up_to_its_done_event(client, stack, sentence) -> None:
    whole = client.audio.transcriptions.create(model=stack.model, file=_file(sentence)).text
    stream = client.audio.transcriptions.create(model=stack.model, file=_file(sentence), stream=True)
    events = list(stream)
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    (done,) = [e for e in events if e.type == "transcript.text.done"]
    assert events[-1] is done and deltas
    assert "".join(d.delta for d in deltas) == done.text == whole
    assert done.usage.input_tokens == round(wav_seconds(sentence) * 50)
    assert done.usage.output_tokens > 0


@pytest.mark.parametrize(
    ("data", "fields", "code"),
    [
        (b"this is not audio at all" * 40, {}, "invalid_audio"),
        (b"", {}, "invalid_audio"),
        (silence_wav(31.0), {}, "audio_too_long"),
        (
            silence_wav(1.0),
            {"timestamp_granularities": ["word"], "response_format": "verbose_json"},
            "unsupported_parameter",
        ),
    ],
    ids=["not-audio", "empty", "too-long", "word-timestamps"],
)
def test_bad_audio_is_a_400_in_openais_shape(client, stack, data, fields, code) -> None:
    before = _listened(stack)
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=stack.model, file=_file(data), **fields)
    assert e.value.status_code == 400
    assert e.value.body["code"] == code and e.value.body["type"] == "invalid_request_error"
    assert _listened(stack) == before, "nothing reached the listener"


def test_a_transcription_for_another_model_is_a_404(client, sentence) -> None:
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=_file(sentence))


def _audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def test_a_chat_hears_its_audio_parts_and_the_thinker_gets_the_transcript(client, stack, sentence) -> None:
    """The prompt the thinker ran is the chat template applied to the transcript in the audio's
    place: its token count, from the thinker's ``usage``, equals the template's count computed
    here from the transcription of the same file."""
    from transformers import AutoTokenizer

    heard = client.audio.transcriptions.create(model=stack.model, file=_file(sentence)).text
    before = _listened(stack)
    r = client.chat.completions.create(
        model=stack.model,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Answer this: "}, _audio_part(sentence)]}
        ],
        max_tokens=4,
    )
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-thinker"))
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"Answer this: {heard}"}], add_generation_prompt=True, tokenize=False
    )
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert r.usage.completion_tokens == 4 and r.choices[0].message.content
    assert _listened(stack)[1] - before[1] == 1, "the listener heard the part once"


def test_a_chat_with_bad_audio_is_a_400_naming_the_part(client, stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": [_audio_part(b"not audio" * 50)]}]
        )
    assert e.value.body["code"] == "invalid_audio"
    assert e.value.body["param"] == "messages.0.content.0.input_audio.data"


def test_silence_transcribes_to_next_to_nothing(client, stack, tmp_path: Path) -> None:
    out = client.audio.transcriptions.create(
        model=stack.model, file=_file(silence_wav(2.0)), response_format="verbose_json"
    )
    assert out.duration == pytest.approx(2.0, abs=0.01)
    assert len(out.text.split()) <= 2, out.text
