"""When text is cut into chunks for a talker: every ``max_tokens`` tokens, or earlier at a
sentence's end (the thinker's output and the gateway's streamed speech input alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

SENTENCE_ENDS = (".", "!", "?")


@dataclass
class TextChunk:
    token_ids: list[int]
    text: str
    offset: int = 0
    """Position of its first token among the request's generated tokens."""


@dataclass
class TextChunker:
    """Groups streamed text tokens into chunks of at most ``max_tokens`` tokens."""

    max_tokens: int
    sentence_end: bool = True
    _ids: list[int] = field(default_factory=list)
    _text: str = ""
    _cut_tokens: int = 0
    """Tokens in the chunks cut so far."""

    def feed(self, token_ids: list[int], text: str) -> list[TextChunk]:
        """Add one streamed delta (whole tokens); return the chunks it completes."""
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
        chunk = TextChunk(self._ids, self._text, self._cut_tokens)
        self._cut_tokens += len(self._ids)
        self._ids, self._text = [], ""
        return chunk
