"""The fault suite's audio accounting: each completed audio stream's chunks against the whole
decode of the code chunks the pipeline sent (``omnirelay verify faults``, both pipelines).

An Orpheus talker speaks each text chunk until end-of-speech or its cap (a function of the chunk's
text, whose cut depends on how vLLM grouped the thinker's tokens into deltas), so no fault-free
request is a reference for another one's length, and a length alone says nothing of order. The
reference is the frames themselves: the suite reads every code chunk the stages stream stored for
code2wav from a mirror of that stream (:mod:`tests.verification.stage_mirror`: it misses nothing that a
broker restart hides from a subscriber, and says when it lacks a message), and after the row decodes
each *segment* (one text chunk's frames) **whole** with the codec adapter, the noise seeded by
absolute frame as in a streamed decode. Its samples, cut by the code chunks' own frames, are the
chunk pieces a client must receive, each once, in order (:func:`judge_chunks`), equal to within
1 LSB of PCM16 (a streamed and a whole float32 decode differ by at most that,
``tests/unit/test_snac_codec.py``). A code chunk stored again (a redo after a talker move) must carry
the same offset, contexts and codes as its first copy, and the own frames of consecutive chunks must
be consecutive (:func:`sent_in_order`). The talker's input must be the thinker's tokens the client
got, each once (:func:`talker_input_unlike`). See docs/reliability.md, "The Orpheus pipeline's rows".

Units: frames (one frame = ``samples_per_frame`` samples, 2,048 for SNAC 24 kHz), PCM16 samples.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

TOLERANCE_LSB = 1
"""The largest difference, in PCM16 steps, between a client's sample and the whole decode's."""


@dataclass(frozen=True)
class SentChunk:
    """One code chunk as sent to code2wav (a copy of it: a redo sends the same seq again)."""

    seq: int
    offset: int
    """Absolute index of the chunk's first own frame, frames."""
    before: int
    """Context frames at the start of ``codes``."""
    after: int
    """Context frames at the end of ``codes``."""
    codes: np.ndarray
    """``[frames, codes_per_frame]`` integer codes, contexts included (``[0, ...]`` when empty)."""
    final: bool = False
    stripped: bool = False
    """A copy a move re-sent without its codes: the client already had the chunk's audio, so the
    new attempt only takes note of it (``services/orchestrator/moves.py``)."""

    @property
    def own(self) -> np.ndarray:
        """The chunk's own frames, ``[own frames, codes_per_frame]``."""
        return self.codes[self.before : len(self.codes) - self.after]

    def same_as(self, other: SentChunk) -> bool:
        """True when ``other`` is this chunk sent again: the same place and the same codes (a
        stripped copy has none to compare)."""
        place = (self.offset, self.before, self.after, self.final)
        if place != (other.offset, other.before, other.after, other.final):
            return False
        return other.stripped or np.array_equal(self.codes, other.codes)


@dataclass(frozen=True)
class SentOrder:
    """A request's code chunks on the bus, each once, and what was wrong with them."""

    chunks: list[SentChunk]
    """The first copy of every seq, by seq."""
    resent: int
    """Copies of a seq after its first (a redo's), like it or not."""
    resent_unlike: int
    """Copies of a seq whose offset, contexts or codes differ from its first copy."""
    seq_gaps: int
    """Seqs absent below the highest one seen, plus 1 when no chunk was ``final``."""
    frame_gaps: int
    """Chunks whose first own frame does not follow the previous chunk's last."""


def sent_in_order(copies: Sequence[SentChunk]) -> SentOrder:
    """The code chunks of one request from every copy seen on the bus (pure)."""
    first: dict[int, SentChunk] = {}
    unlike = 0
    for c in copies:
        if c.seq in first:
            unlike += not first[c.seq].same_as(c)
        else:
            first[c.seq] = c
    chunks = [first[s] for s in sorted(first)]
    top = max(first, default=-1)
    gaps = (top + 1 - len(first)) + (not any(c.final for c in chunks))
    frame_gaps = sum(b.offset != a.offset + len(a.own) for a, b in itertools.pairwise(chunks))
    return SentOrder(chunks, len(copies) - len(first), unlike, gaps, frame_gaps)


def segment_bounds(chunks: Sequence[SentChunk]) -> list[tuple[int, int]]:
    """``[start, stop)`` indices into ``chunks`` (in seq order) of each segment: a chunk with no
    context after it ends its segment (a segment's chunks take context from that segment only)."""
    bounds, start = [], 0
    for i, c in enumerate(chunks):
        if c.after == 0:
            bounds.append((start, i + 1))
            start = i + 1
    if start < len(chunks):
        bounds.append((start, len(chunks)))
    return bounds


def expected_pieces(
    chunks: Sequence[SentChunk], decode: Callable[[np.ndarray, int], np.ndarray], samples_per_frame: int
) -> list[np.ndarray]:
    """The PCM16 each chunk's own frames must come out as: each segment's own frames decoded whole
    (``decode(frames, first_frame)`` → ``frames × samples_per_frame`` int16 samples), cut by the
    chunks' own frames. A chunk without own frames gets an empty piece."""
    pieces: list[np.ndarray] = []
    for start, stop in segment_bounds(chunks):
        part = chunks[start:stop]
        own = [c.own for c in part]
        frames = np.concatenate(own) if part else np.zeros((0, 7), np.int64)
        whole = decode(frames, part[0].offset) if len(frames) else np.zeros(0, np.int16)
        at = 0
        for o in own:
            pieces.append(whole[at : at + len(o) * samples_per_frame])
            at += len(o) * samples_per_frame
    return pieces


@dataclass(frozen=True)
class ChunkCount:
    """A client's audio chunks against the pieces it should have got (:func:`judge_chunks`)."""

    expected: int
    """Pieces with samples."""
    matched: int
    missing: int
    """Pieces no client chunk matched, or skipped over by a later match."""
    repeated: int
    """Client chunks equal to a piece already matched."""
    unlike: int
    """Client chunks equal to no piece."""

    @property
    def whole(self) -> bool:
        return self.matched == self.expected and not (self.missing or self.repeated or self.unlike)


def _equal(piece: np.ndarray, got: np.ndarray) -> bool:
    """Same length, every sample within :data:`TOLERANCE_LSB`."""
    if len(piece) != len(got):
        return False
    return not len(piece) or int(np.abs(piece.astype(np.int32) - got.astype(np.int32)).max()) <= TOLERANCE_LSB


def judge_chunks(pieces: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> ChunkCount:
    """Walk the client's chunks (PCM16 arrays, in arrival order) along the expected ``pieces``
    (:func:`expected_pieces`, empty ones left out): the next piece matched moves on; a chunk equal
    to a later piece marks the ones between missing; a chunk equal to an earlier matched piece is
    repeated; any other chunk is unlike (pure)."""
    want = [p for p in pieces if len(p)]
    matched = repeated = unlike = skipped = 0
    done: set[int] = set()
    nxt = 0
    for chunk in (g for g in got if len(g)):
        hit = next((j for j in range(nxt, len(want)) if _equal(want[j], chunk)), None)
        if hit is not None:
            skipped += hit - nxt
            matched += 1
            done.add(hit)
            nxt = hit + 1
        elif any(_equal(want[j], chunk) for j in done):
            repeated += 1
        else:
            unlike += 1
    return ChunkCount(len(want), matched, skipped + len(want) - nxt, repeated, unlike)


@dataclass(frozen=True)
class SentText:
    """One text chunk as sent to the talker (a copy of it: a thinker's redo sends the seq again)."""

    seq: int
    offset: int
    """Position of its first token among the thinker's tokens."""
    token_ids: tuple[int, ...]
    final: bool = False
    to: str = "?"
    """The talker replica it was sent to and its sender (``<replica><<stage>.<replica>``, from its
    headers: ``1<0.0`` from thinker replica 0, ``1<orchestrator.orchestrator`` re-sent by a move)."""


def talker_input_unlike(copies: Sequence[SentText], tokens: Sequence[int]) -> bool:
    """True unless the talker's input is the thinker's ``tokens`` (what the client got), each once
    (pure): the first copy of every seq from 0 to a ``final`` one, each starting where the one
    before ended (the first at 0), their tokens joined equal to ``tokens``, and every later copy of
    a seq the same as its first (a seq re-sent with other tokens would leave the talker, which
    keeps the first, with a gap or an overlap)."""
    first: dict[int, SentText] = {}
    for c in copies:
        if c.seq in first:
            if (first[c.seq].offset, first[c.seq].token_ids) != (c.offset, c.token_ids):
                return True
        else:
            first[c.seq] = c
    chunks = [first[s] for s in sorted(first)]
    if [c.seq for c in chunks] != list(range(len(chunks))) or not chunks or not chunks[-1].final:
        return True
    at = 0
    for c in chunks:
        if c.offset != at:
            return True
        at += len(c.token_ids)
    return [t for c in chunks for t in c.token_ids] != list(tokens)


@dataclass
class CodeCapture:
    """Every text chunk sent to the talker (stage ``stage - 1``) and every code chunk sent to
    code2wav (stage ``stage``) of pipeline ``pipeline``, by request (a redo's copies too), as the
    stages stream stored them (:meth:`ChunkJudge.capture` reads them from its mirror)."""

    pipeline: str
    stage: int = 2
    codes_per_frame: int = 7
    sent: dict[str, list[SentChunk]] = field(default_factory=dict)
    texts: dict[str, list[SentText]] = field(default_factory=dict)
    unread: int = 0
    """Messages the stages stream stored while the capture ran that it could not read: the
    reference is incomplete, and a stream it does not find whole is not judged."""

    def add(self, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
        """Take one stored stage message (``subject`` ``omni.<pipeline>.stage.<s>.<r>.in``)."""
        from libs.common import headers as h
        from libs.common.envelopes import StageTask, TaskKind, decode

        stage = int(subject.split(".")[3])
        if stage not in (self.stage - 1, self.stage):
            return
        task = decode(StageTask, data)
        if task.kind != TaskKind.CHUNK:
            return
        if stage == self.stage:
            empty = np.zeros((0, self.codes_per_frame), np.int64)
            codes = empty if task.codes is None else task.codes.to_numpy().reshape(-1, self.codes_per_frame)
            stripped = task.moved and task.codes is None  # the client had its audio (a move)
            chunk = SentChunk(
                task.seq, task.offset, task.context_before, task.context_after, codes, task.final, stripped
            )
            self.sent.setdefault(task.request_id, []).append(chunk)
            return
        hdr = headers or {}
        to = f"{hdr.get(h.TO_REPLICA, '?')}<{hdr.get(h.FROM_STAGE, '?')}.{hdr.get(h.FROM_REPLICA, '?')}"
        text = SentText(task.seq, task.offset, tuple(task.token_ids or ()), task.final, to)
        self.texts.setdefault(task.request_id, []).append(text)

    def summary(self, rid: str) -> str:
        """What the bus carried for request ``rid``, in one line (for a stream that failed or was
        not whole): each text chunk copy as ``seq@`` :attr:`SentText.to` (``F``: final) in arrival
        order, and the code chunks' seqs, copies and final."""
        texts = " ".join(f"{t.seq}{'F' if t.final else ''}@{t.to}" for t in self.texts.get(rid, []))
        codes = self.sent.get(rid, [])
        seqs = sorted({c.seq for c in codes})
        final = [c.seq for c in codes if c.final]
        span = f"{seqs[0]}..{seqs[-1]} ({len(seqs)} distinct)" if seqs else "none"
        return (
            f"request {rid}: text chunks to the talker: {texts or 'none'}; code chunks {span}, "
            f"{len(codes) - len(seqs)} re-sent, final {final or 'none'}"
        )


@dataclass(frozen=True)
class StreamAudio:
    """The verdict on one completed stream's audio."""

    sent: SentOrder
    chunks: ChunkCount
    input_unlike: bool = False
    """The talker's input was not the thinker's tokens, each once (:func:`talker_input_unlike`)."""

    @property
    def whole(self) -> bool:
        s = self.sent
        bus_clean = not (s.resent_unlike or s.seq_gaps or s.frame_gaps or self.input_unlike)
        return self.chunks.whole and bus_clean


def judge_stream(
    copies: Sequence[SentChunk],
    got: Sequence[bytes],
    decode: Callable[[np.ndarray, int], np.ndarray],
    samples_per_frame: int,
) -> StreamAudio:
    """One stream's audio: its code chunks' copies on the bus, the client's audio chunks (PCM16
    bytes, in arrival order), judged with ``decode`` as the whole-segment reference."""
    order = sent_in_order(copies)
    pieces = expected_pieces(order.chunks, decode, samples_per_frame)
    client = [np.frombuffer(b, dtype="<i2") for b in got]
    return StreamAudio(order, judge_chunks(pieces, client))


@dataclass(frozen=True)
class AudioTally:
    """The audio verdicts of a row's completed streams, summed."""

    streams: int
    whole: int
    """Streams with every piece once, in order, nothing else, and a clean bus (:attr:`StreamAudio.whole`)."""
    expected: int
    """Audio chunks the streams' code chunks called for."""
    missing: int
    repeated: int
    unlike: int
    input_unlike: int
    """Streams whose talker input was not the thinker's tokens, each once."""
    resent: int
    """Code chunks sent again (a redo after a talker move): how often the resend check ran."""
    resent_unlike: int
    gaps: int
    """Seq gaps and frame gaps on the bus."""
    unread: int = 0
    """Messages the stages stream stored during the row that the capture could not read."""
    unjudged: int = 0
    """Streams not whole against a reference that lacks :attr:`unread` messages: not judged."""

    @classmethod
    def of(cls, verdicts: Sequence[StreamAudio]) -> AudioTally:
        return cls(
            len(verdicts),
            sum(v.whole for v in verdicts),
            sum(v.chunks.expected for v in verdicts),
            sum(v.chunks.missing for v in verdicts),
            sum(v.chunks.repeated for v in verdicts),
            sum(v.chunks.unlike for v in verdicts),
            sum(v.input_unlike for v in verdicts),
            sum(v.sent.resent for v in verdicts),
            sum(v.sent.resent_unlike for v in verdicts),
            sum(v.sent.seq_gaps + v.sent.frame_gaps for v in verdicts),
        )


class ChunkJudge:
    """The suite's side of the chunk judge: a bus capture per row and the codec that decodes the
    whole-segment reference (loaded once, in the suite's process)."""

    def __init__(self, pipeline: str, codec_dir: str) -> None:
        import torch

        from services.stage_worker.codecs import load_codec_adapter

        torch.set_num_threads(1)  # as code2wav decodes: the split of a pass's sums moves float32 bits
        self.pipeline = pipeline
        self.codec = load_codec_adapter(codec_dir)

    @contextlib.asynccontextmanager
    async def capture(self, stack) -> AsyncIterator[CodeCapture]:
        """A :class:`CodeCapture` of what ``stack``'s stages stream stores while the block runs,
        filled from its mirror (:class:`~tests.verification.stage_mirror.StageMirror`) when the block
        ends; the connection reconnects without end while the block runs (a broker restart)."""
        import nats

        from libs.common.bus import server_urls
        from tests.verification.stage_mirror import StageMirror

        async def quiet(_: Exception) -> None:
            return None

        nc = await nats.connect(
            servers=server_urls(stack.nats_url),
            error_cb=quiet,
            reconnect_time_wait=0.1,
            max_reconnect_attempts=-1,
        )
        capture = CodeCapture(self.pipeline, codes_per_frame=self.codec.codes_per_frame)
        try:
            mirror = StageMirror(nc, self.pipeline)
            await mirror.ensure()
            first = await mirror.last_seq()
            yield capture
            read = await mirror.read_after(first)
            for m in read.messages:
                capture.add(m.subject, m.headers, m.data)
            capture.unread = read.unread
        finally:
            await nc.close()

    def tally(
        self, streams: Sequence[tuple[str, Sequence[bytes], Sequence[int]]], capture: CodeCapture
    ) -> tuple[AudioTally, list[str]]:
        """The verdicts of completed streams, given as (request id, PCM16 of each audio chunk,
        the thinker's token ids the client got), and the ids of those not whole."""

        def decode(frames: np.ndarray, first_frame: int) -> np.ndarray:
            return self.codec.decode(frames, first_frame)

        per_frame = self.codec.samples_per_frame
        verdicts, broken, unjudged = [], [], 0
        for rid, got, tokens in streams:
            verdict = judge_stream(capture.sent.get(rid, []), got, decode, per_frame)
            verdict = replace(verdict, input_unlike=talker_input_unlike(capture.texts.get(rid, []), tokens))
            if not verdict.whole and capture.unread:
                unjudged += 1  # its reference may lack what the client got
            else:
                verdicts.append(verdict)
            if not verdict.whole:
                broken.append(rid)
        return replace(AudioTally.of(verdicts), unread=capture.unread, unjudged=unjudged), broken
