"""When a stage forwards its output downstream: pure functions of what was produced so far."""

from __future__ import annotations

from dataclasses import dataclass, field

SENTENCE_ENDS = (".", "!", "?")


@dataclass
class TextChunk:
    token_ids: list[int]
    text: str


@dataclass
class TextChunker:
    """Groups streamed text tokens into chunks of at most ``max_tokens`` tokens, cutting early
    after a token whose text ends a sentence when ``sentence_end`` is set."""

    max_tokens: int
    sentence_end: bool = True
    _ids: list[int] = field(default_factory=list)
    _text: str = ""

    def feed(self, token_ids: list[int], text: str) -> list[TextChunk]:
        """Add one streamed delta; return the chunks it completes (usually zero or one).

        Deltas carry whole tokens; a delta's text is attributed to its last token, which is
        how vLLM's incremental detokenizer reports it.
        """
        out: list[TextChunk] = []
        self._text += text
        for tid in token_ids:
            self._ids.append(tid)
            if len(self._ids) >= self.max_tokens:
                out.append(self._cut())
        if self._ids and self.sentence_end and self._text.rstrip().endswith(SENTENCE_ENDS):
            out.append(self._cut())
        return out

    def flush(self) -> TextChunk:
        """Whatever is left (possibly empty) as the last chunk."""
        return self._cut()

    def _cut(self) -> TextChunk:
        chunk = TextChunk(self._ids, self._text)
        self._ids, self._text = [], ""
        return chunk


@dataclass
class CodeChunker:
    """Groups streamed codec codes into chunks of exactly ``size`` codes (the last may be short)."""

    size: int
    _codes: list[int] = field(default_factory=list)

    def feed(self, codes: list[int]) -> list[list[int]]:
        self._codes.extend(codes)
        out = []
        while len(self._codes) >= self.size:
            out.append(self._codes[: self.size])
            self._codes = self._codes[self.size :]
        return out

    def flush(self) -> list[int]:
        rest, self._codes = self._codes, []
        return rest
