"""Pipeline YAML: the shipped files load; bad files fail naming file, field and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.common.pipeline import DEFAULT_PIPELINE_PATH, PipelineConfigError, load_pipeline


def test_default_pipeline_is_the_listener_then_the_three_stage_chain() -> None:
    p = load_pipeline()
    assert [s.name for s in p.stages] == ["listener", "thinker", "talker", "code2wav"]
    assert (p.listener_stage, p.thinker_stage, p.speech_stage, p.audio_stage) == (0, 1, 2, 3)
    assert p.stages_for(audio=False, entry=1) == [1] and p.stages_for(audio=True, entry=1) == [1, 2, 3]
    assert p.stages_for(audio=False, entry=0) == [0] and p.thinker.replicas == 2


def test_every_shipped_pipeline_loads() -> None:
    shipped = sorted(DEFAULT_PIPELINE_PATH.parent.glob("*.yaml"))
    assert DEFAULT_PIPELINE_PATH in shipped and len(shipped) > 1, shipped
    for path in shipped:
        assert load_pipeline(path).stages


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


GOOD_STAGE = "  - {name: thinker, type: llm, model: m, consumes: text, emits: text}\n"
LISTENER = "  - {name: l, type: asr, model: whisper-tiny-en, consumes: audio, emits: text}\n"


def test_a_listener_comes_first_and_requests_enter_where_their_input_is(tmp_path: Path) -> None:
    p = load_pipeline(_write(tmp_path, "name: x\nserved_model_name: y\nstages:\n" + LISTENER + GOOD_STAGE))
    assert (p.listener_stage, p.thinker_stage) == (0, 1)
    assert p.stages_for(audio=False, entry=0) == [0], "a transcription runs the listener alone"
    assert p.stages_for(audio=False, entry=1) == [1]
    assert [p.upstream(s) for s in (0, 1)] == [None, None], "the thinker takes no chunks of the listener"
    plain = load_pipeline(DEFAULT_PIPELINE_PATH.with_name("text-only.yaml"))
    assert (plain.listener_stage, plain.thinker_stage) == (None, 0)
    assert load_pipeline().upstream(2) == 1, "the talker takes the thinker's chunks"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("name: x\nserved_model_name: y\nstages: []\n", ["field 'stages'"]),
        ("name: x\nstages:\n" + GOOD_STAGE, ["field 'served_model_name'", "Field required"]),
        ("name: Bad Name\nserved_model_name: y\nstages:\n" + GOOD_STAGE, ["field 'name'"]),
        (
            "name: x\nserved_model_name: y\nstages:\n"
            + GOOD_STAGE.replace("replicas", "")
            + "  - {name: t, type: llm, model: m, consumes: audio, emits: text}\n",
            ["stages[1].consumes is 'audio'", "emits 'text'"],
        ),
        (
            "name: x\nserved_model_name: y\nstages:\n" + GOOD_STAGE.replace("type: llm", "type: gpu"),
            ["stages.0.type"],
        ),
        (
            "name: x\nserved_model_name: y\nstages:\n" + GOOD_STAGE.replace("}", ", replicas: 0}"),
            ["stages.0.replicas"],
        ),
        (
            "name: x\nserved_model_name: y\nbogus: 1\nstages:\n" + GOOD_STAGE,
            ["field 'bogus'", "Extra inputs"],
        ),
        ("name: x\nserved_model_name: y\nstages:\n" + LISTENER, ["a thinker must come after it"]),
        (
            "name: x\nserved_model_name: y\nstages:\n" + GOOD_STAGE + LISTENER,
            ["stages[1].consumes is 'audio'"],
        ),
        (
            "name: x\nserved_model_name: y\nstages:\n" + LISTENER + LISTENER.replace("name: l", "name: m"),
            ["stages[1] must be an 'llm' stage"],
        ),
        (
            "name: x\nserved_model_name: y\nstages:\n"
            + GOOD_STAGE.replace("}", ", listener: {beam_size: 2}}"),
            ["stages[0].listener: only an asr stage"],
        ),
        ("- just\n- a list\n", ["top level must be a mapping"]),
        ("name: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_invalid_pipeline_names_file_field_and_reason(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(PipelineConfigError) as e:
        load_pipeline(path)
    assert str(path) in str(e.value)
    for f in fragments:
        assert f in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PipelineConfigError, match="cannot read pipeline file"):
        load_pipeline(tmp_path / "nope.yaml")
