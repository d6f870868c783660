"""services/gateway/speech_input.speech_chunks: where a speech request's input is cut."""

from __future__ import annotations

import pytest

from services.gateway.speech_input import speech_chunks


@pytest.mark.parametrize(
    ("text", "chunks"),
    [
        ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
        ("  One sentence without an end  ", ["One sentence without an end"]),
        ('He said "stop." Then left…  Yes', ['He said "stop."', "Then left…", "Yes"]),
        ("Version 2.5 is out. 3.14 too.", ["Version 2.5 is out.", "3.14 too."]),
        ("First line.\n\nSecond line.", ["First line.", "Second line."]),
        ("你好。再见！", ["你好。再见！"]),  # no space after the full stop: one chunk
        ("   \n\t ", []),
    ],
)
def test_sentences_are_the_chunks(text: str, chunks: list[str]) -> None:
    assert speech_chunks(text) == chunks


def test_a_long_sentence_is_cut_at_a_clause_mark_then_at_a_space_then_anywhere() -> None:
    clause = "alpha beta gamma, delta epsilon zeta"
    assert speech_chunks(clause, max_chars=20) == ["alpha beta gamma,", "delta epsilon zeta"]
    words = "one two three four five six seven"
    assert speech_chunks(words, max_chars=10) == ["one two", "three four", "five six", "seven"]
    assert speech_chunks("x" * 25, max_chars=10) == ["x" * 10, "x" * 10, "x" * 5]


@pytest.mark.parametrize("max_chars", [5, 17, 40, 300])
def test_no_chunk_is_longer_than_the_cap_and_no_word_is_lost(max_chars: int) -> None:
    text = (
        "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, "
        "his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly "
        "through the glass doors of Victory Mansions; not quickly enough to prevent a swirl of "
        "gritty dust from entering along with him. " * 3
    )
    chunks = speech_chunks(text, max_chars=max_chars)
    assert all(0 < len(c) <= max_chars for c in chunks)
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")
