"""A speech request's input text, cut into the chunks a talker speaks one at a time.

A talker speaks each chunk as one engine request (one *segment* of audio for an ``orpheus``
talker, with its own prosody), so the cuts go where a speaker pauses: after a sentence's end
(``.``, ``!``, ``?``, ``…`` and their full-width forms, then a space or the end), then at a clause
mark (``,``, ``;``, ``:``, dashes) or a space when a sentence is longer than the cap, and only as a
last resort inside a word. The chunks hold every character of the input between them except the
spaces at the cuts, in order.
"""

from __future__ import annotations

import re

MAX_CHUNK_CHARS = 300
"""Longest chunk, characters: a talker's output cap is proportional to its chunk's length, and a
shorter chunk reaches the client's ear sooner; a sentence is usually well under it."""

_SENTENCE_END = re.compile(r"(?:(?<=[.!?…。！？])|(?<=[.!?…。！？][\"'”’)\]]))\s+")
"""The white space after a sentence's end mark (and a closing quote or bracket after it)."""
_CLAUSE_MARK = re.compile(r"[,;:—–]\s+")


def speech_chunks(text: str, max_chars: int = MAX_CHUNK_CHARS) -> list[str]:
    """``text`` cut into chunks of at most ``max_chars`` characters (see the module's docstring);
    an input of only white space has none."""
    chunks: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        sentence = sentence.strip()
        while len(sentence) > max_chars:
            cut = _cut_point(sentence, max_chars)
            chunks.append(sentence[:cut].rstrip())
            sentence = sentence[cut:].lstrip()
        if sentence:
            chunks.append(sentence)
    return chunks


def _cut_point(sentence: str, max_chars: int) -> int:
    """Where to cut a ``sentence`` longer than ``max_chars``: after the last clause mark within
    the first ``max_chars`` characters, else at the last space there, else at ``max_chars``."""
    head = sentence[: max_chars + 1]
    marks = [m.end() for m in _CLAUSE_MARK.finditer(head) if m.start() < max_chars]
    if marks:
        return marks[-1]
    space = head.rfind(" ", 1, max_chars + 1)
    return space if space > 0 else max_chars
