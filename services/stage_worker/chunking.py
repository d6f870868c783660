"""When a stage forwards its output downstream: pure functions of what was produced so far."""

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
    """Groups streamed text tokens into chunks of at most ``max_tokens`` tokens, cutting early
    after a token whose text ends a sentence when ``sentence_end`` is set."""

    max_tokens: int
    sentence_end: bool = True
    _ids: list[int] = field(default_factory=list)
    _text: str = ""
    _cut_tokens: int = 0
    """Tokens in the chunks cut so far."""

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
        chunk = TextChunk(self._ids, self._text, self._cut_tokens)
        self._cut_tokens += len(self._ids)
        self._ids, self._text = [], ""
        return chunk


@dataclass
class CodeChunker:
    """Cuts a request's codec codes into chunks of exactly ``size`` codes: chunk ``k`` holds codes
    ``k·size`` to ``(k+1)·size − 1`` of the request's code stream, the last one may be short.

    The numbering depends only on positions, so a talker that takes a request over from a dead
    one cuts the same chunks with the same numbers: it starts at ``start``, the position of the
    first code it will be fed (where the oldest text chunk the dead one had not acknowledged
    begins), and drops the codes before the first chunk boundary at or after it — those went out
    in a chunk shared with the previous text chunk, which was acknowledged only once that chunk
    had been sent.
    """

    size: int
    start: int = 0
    _codes: list[int] = field(default_factory=list)
    _skip: int = 0
    next_seq: int = 0
    """The number of the next chunk cut."""

    def __post_init__(self) -> None:
        self.next_seq = -(-self.start // self.size)
        self._skip = self.next_seq * self.size - self.start

    @property
    def sent_upto(self) -> int:
        """Codes before this position are in chunks already cut (or were dropped as sent)."""
        return self.next_seq * self.size

    def feed(self, codes: list[int]) -> list[tuple[int, list[int]]]:
        """Add codes; return the chunks they complete, numbered."""
        dropped = min(self._skip, len(codes))
        self._skip -= dropped
        self._codes.extend(codes[dropped:])
        out = []
        while len(self._codes) >= self.size:
            out.append((self.next_seq, self._codes[: self.size]))
            self._codes = self._codes[self.size :]
            self.next_seq += 1
        return out

    def flush(self) -> tuple[int, list[int]]:
        """The last chunk (whatever is left, possibly nothing), numbered."""
        rest, self._codes = self._codes, []
        self.next_seq += 1
        return self.next_seq - 1, rest
