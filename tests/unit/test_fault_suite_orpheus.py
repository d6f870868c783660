"""The fault suite's Orpheus rows: the pipeline it runs (built from compose/pipelines/orpheus-tiny.yaml)
and the chunk judge of a variable-length audio stream (tests/verification/audio_accounting.py), fed with
code chunks cut by the talker's own chunker and decoded chunk by chunk by the real SNAC adapter on a
seeded tiny-snac, as code2wav does; the reference is the judge's whole-segment decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from libs.common.envelopes import NdArray, StageTask, TaskKind
from libs.common.pipeline import load_pipeline
from libs.models.tiny_snac import CODEBOOK_SIZE, build_tiny_snac
from libs.stack.process_plan import plan_services
from services.stage_worker.chunking import FrameChunker
from services.stage_worker.codecs.snac import CONTEXT_FRAMES, SnacCodecAdapter
from tests.verification.audio_accounting import (
    AudioTally,
    CodeCapture,
    SentChunk,
    SentText,
    judge_chunks,
    judge_stream,
    segment_bounds,
    sent_in_order,
    talker_input_unlike,
)
from tests.verification.fault_injection import REPLICAS, STAGE_NAMES, victim_service
from tests.verification.fault_pipelines import ORPHEUS_FAULTS, pipelines
from tests.verification.fault_suite import Row, render, replaced_by_a_new_process

SAMPLES_PER_FRAME = 2048
"""SNAC 24 kHz: one frame is 4 hops of 512 samples."""


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> SnacCodecAdapter:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as code2wav and the judge decode
    directory = tmp_path_factory.mktemp("tiny-snac")
    build_tiny_snac(directory)
    yield SnacCodecAdapter.load(directory)
    torch.set_num_threads(threads)


def _talk(segments: list[int], size: int = 6, seed: int = 3) -> list[SentChunk]:
    """A request's code chunks as a talker sends them: one segment of random in-range frames per
    text chunk (``segments``: frames of each), cut by the talker's :class:`FrameChunker` with SNAC's
    context; the last chunk is ``final``."""
    rng = np.random.default_rng(seed)
    chunker = FrameChunker(size, CONTEXT_FRAMES, 7)
    cut = []
    for i, n in enumerate(segments):
        cut += chunker.feed(rng.integers(0, CODEBOOK_SIZE, (n, 7), dtype=np.int32))
        cut += chunker.end_segment(last=i == len(segments) - 1)
    return [
        SentChunk(c.seq, c.first_frame, c.before, c.after, c.frames, final=k == len(cut) - 1)
        for k, c in enumerate(cut)
    ]


def _streamed(adapter: SnacCodecAdapter, chunks: list[SentChunk]) -> list[bytes]:
    """What code2wav sends the client: each chunk decoded alone with its contexts (empty ones skipped)."""
    out = []
    for c in chunks:
        if len(c.own):
            out.append(adapter.decode(c.codes, c.offset, c.before, c.after).tobytes())
    return out


def _decode(adapter: SnacCodecAdapter):
    return lambda frames, first: adapter.decode(frames, first)


def test_a_streamed_stream_is_whole_and_its_audio_is_its_frames(adapter: SnacCodecAdapter) -> None:
    chunks = _talk([14, 6, 9])  # 3 segments: 6+6+2, 6, 6+3 own frames
    assert [len(c.own) for c in chunks] == [6, 6, 2, 6, 6, 3]
    assert segment_bounds(chunks) == [(0, 3), (3, 4), (4, 6)]
    got = _streamed(adapter, chunks)
    verdict = judge_stream(chunks, got, _decode(adapter), SAMPLES_PER_FRAME)
    assert verdict.whole and verdict.chunks.expected == verdict.chunks.matched == 6
    assert sum(len(g) for g in got) == 29 * SAMPLES_PER_FRAME * 2  # PCM16 bytes of 29 frames


def test_the_judge_reports_a_missing_a_repeated_and_an_unlike_chunk(adapter: SnacCodecAdapter) -> None:
    chunks = _talk([14, 6, 9])
    got = _streamed(adapter, chunks)
    decode = _decode(adapter)
    missing = judge_stream(chunks, got[:2] + got[3:], decode, SAMPLES_PER_FRAME)
    assert (missing.chunks.missing, missing.chunks.repeated, missing.chunks.unlike) == (1, 0, 0)
    assert not missing.whole
    repeated = judge_stream(chunks, got[:4] + got[3:], decode, SAMPLES_PER_FRAME)  # chunk 3 twice
    assert (repeated.chunks.missing, repeated.chunks.repeated, repeated.chunks.unlike) == (0, 1, 0)
    last = judge_stream(chunks, got[:-1], decode, SAMPLES_PER_FRAME)  # the stream cut short
    assert (last.chunks.matched, last.chunks.missing) == (5, 1)
    # Chunk 1 decoded without its context after it: its samples near the end are not the whole
    # decode's; the same length, so only the samples tell.
    c = chunks[1]
    alone = adapter.decode(c.codes[: len(c.codes) - c.after], c.offset, c.before, 0).tobytes()
    assert len(alone) == len(got[1])
    unlike = judge_stream(chunks, [got[0], alone, *got[2:]], decode, SAMPLES_PER_FRAME)
    # its piece never came as it should (missing), and a chunk like none came (unlike)
    assert (unlike.chunks.missing, unlike.chunks.unlike, unlike.chunks.matched) == (1, 1, 5)
    assert not unlike.whole


def test_a_redo_must_resend_the_same_chunk_and_the_bus_must_have_every_seq() -> None:
    chunks = _talk([14, 6])
    again = chunks[1]
    redo_same = sent_in_order([*chunks, again])
    assert (redo_same.resent, redo_same.resent_unlike, redo_same.seq_gaps, redo_same.frame_gaps) == (
        1,
        0,
        0,
        0,
    )
    other = SentChunk(again.seq, again.offset, again.before, again.after, again.codes + 1, again.final)
    redo_other = sent_in_order([*chunks, other])
    assert (redo_other.resent, redo_other.resent_unlike) == (1, 1)
    # a move re-sends a chunk whose audio the client has without its codes: the same chunk
    empty = again.codes[:0]
    stripped = SentChunk(
        again.seq, again.offset, again.before, again.after, empty, again.final, stripped=True
    )
    assert sent_in_order([*chunks, stripped]).resent_unlike == 0
    elsewhere = SentChunk(again.seq, again.offset + 1, again.before, again.after, empty, again.final, True)
    assert sent_in_order([*chunks, elsewhere]).resent_unlike == 1  # stripped, but not in its place
    unstripped = SentChunk(again.seq, again.offset, again.before, again.after, empty, again.final)
    assert sent_in_order([*chunks, unstripped]).resent_unlike == 1  # codes lost on a plain copy
    assert sent_in_order(chunks[:1] + chunks[2:]).seq_gaps == 1  # seq 1 never seen
    assert sent_in_order(chunks[:-1]).seq_gaps == 1  # no final chunk
    moved = SentChunk(again.seq, again.offset + 1, again.before, again.after, again.codes, again.final)
    order = sent_in_order([chunks[0], moved, *chunks[2:]])
    assert order.frame_gaps == 2  # chunk 1 starts a frame late, and chunk 2 then overlaps it


def test_chunks_are_matched_in_order_by_their_samples() -> None:
    a, b, c = (np.full(4, v, np.int16) for v in (0, 100, 200))
    assert judge_chunks([a, b, c], [a, b + 1, c]).whole  # within 1 PCM16 step
    swapped = judge_chunks([a, b, c], [a, c, b])  # c skips b (missing), b then matches nothing left (unlike)
    assert (swapped.matched, swapped.missing, swapped.repeated, swapped.unlike) == (2, 1, 0, 1)
    assert judge_chunks([a, b, np.zeros(0, np.int16), c], [a, b, c]).whole  # an empty final chunk
    assert judge_chunks([a, b], [a, b + 2]).unlike == 1


def test_the_orpheus_pipeline_is_the_tiny_orpheus_file_with_two_replicas_and_the_suites_names(
    tmp_path: Path,
) -> None:
    spec = pipelines()["orpheus"]
    path = tmp_path / "faults.yaml"
    path.write_text(spec.yaml)
    pipeline = load_pipeline(path)
    orpheus_tiny = load_pipeline(Path(__file__).resolve().parents[2] / "compose/pipelines/orpheus-tiny.yaml")
    assert tuple(s.name for s in pipeline.stages) == STAGE_NAMES
    assert [s.replicas for s in pipeline.stages] == [REPLICAS] * 3
    speaking = orpheus_tiny.stages[orpheus_tiny.thinker_stage :]  # the suite leaves the listener out
    assert [s.model for s in pipeline.stages] == [s.model for s in speaking]
    assert pipeline.stages[1].talker == speaking[1].talker
    assert pipeline.stages[1].talker.protocol == "orpheus" and spec.codec_model == "tiny-snac"
    planned = {s.name for s in plan_services(pipeline, path, "nats://x", 1, True)}
    single = [f for f in ORPHEUS_FAULTS if f.target in ("worker", "engine_core", "orchestrator")]
    assert {victim_service(f, r) for f in single for r in range(REPLICAS)} <= planned
    assert {f.stage for f in ORPHEUS_FAULTS if f.target == "engine_core"} == {0, 1}  # thinker and talker
    assert all(f.audio for f in ORPHEUS_FAULTS)
    assert {f.name for f in ORPHEUS_FAULTS if not replaced_by_a_new_process(f)} == {
        "SIGSTOP a thinker replica 30 s",
        "SIGSTOP a talker replica 30 s",
        "kill -9 nats-server, back 2 s later",
    }


def test_a_judged_row_gets_the_chunk_columns_and_a_tiny_row_keeps_its_own() -> None:
    tally = AudioTally(
        streams=4,
        whole=3,
        expected=80,
        missing=1,
        repeated=0,
        unlike=0,
        input_unlike=1,
        resent=5,
        resent_unlike=0,
        gaps=0,
    )
    row = Row("kill -9 a talker replica", "pid 7 gone", 4, 4, {}, 0, 0, 0, 0.5, (20.0, 30.0), chunks=tally)
    plain = Row("kill -9 a talker replica", "pid 7 gone", 4, 4, {}, 0, 0, 0, 0.5, (20.0, 30.0))
    assert render([row]).splitlines()[-1].endswith("| 3 / 4 | 80 | 1 | 0 | 0 | 1 | 5 (0) / 0 | 0 (0) |")
    assert render([plain]).splitlines()[-1].endswith("| 20.00–30.00 | - | - |")
    assert render([plain, row]).splitlines()[-2].endswith("| - | - | - | - | - | - | - | - |")


def test_the_talker_input_must_be_the_thinkers_tokens_each_once() -> None:
    tokens = list(range(100, 110))
    texts = [
        SentText(0, 0, (100, 101, 102)),
        SentText(1, 3, (103, 104, 105, 106)),
        SentText(2, 7, (107, 108, 109), True),
    ]
    assert not talker_input_unlike(texts, tokens)
    assert not talker_input_unlike([*texts, texts[1]], tokens)  # a thinker's redo re-sent seq 1 as it was
    assert talker_input_unlike([texts[0], texts[2]], tokens)  # seq 1 never reached the talker
    assert talker_input_unlike(texts[:2], tokens)  # no final chunk
    assert talker_input_unlike(texts, [*tokens, 110])  # the client got a token the talker did not
    # a redo cut seq 1 elsewhere: the talker keeps the first copy, and 106 would be spoken twice
    assert talker_input_unlike([*texts, SentText(1, 3, (103, 104, 105, 106, 107))], tokens)
    shifted = [texts[0], SentText(1, 4, (104, 105, 106)), texts[2]]  # 103 skipped
    assert talker_input_unlike(shifted, [t for t in tokens if t != 103])


def test_the_capture_summarises_what_the_bus_carried_for_a_stream() -> None:
    capture = CodeCapture("faults")
    capture.texts["r"] = [
        SentText(0, 0, (1,), to="0<0.0"),
        SentText(0, 0, (1,), to="1<orchestrator.orchestrator"),
    ]
    capture.sent["r"] = _talk([14])[:2] + _talk([14])[:1]  # chunk 0 re-sent, the final one never
    assert capture.summary("r") == (
        "request r: text chunks to the talker: 0@0<0.0 0@1<orchestrator.orchestrator; "
        "code chunks 0..1 (2 distinct), 1 re-sent, final none"
    )
    assert capture.summary("other").endswith(
        "text chunks to the talker: none; code chunks none, 0 re-sent, final none"
    )


def test_the_capture_takes_a_chunk_a_move_sent_on_without_its_codes_as_that_chunk() -> None:
    """What the stages stream stored: code chunk 0 as the talker sent it, then as a move sent it
    on without its codes (the client had its audio), then a copy that lost its codes otherwise."""
    capture = CodeCapture("faults", codes_per_frame=1)
    task = StageTask(
        request_id="r",
        gateway_id="g",
        arrival_ns=0,
        deadline_ns=1,
        route=[0, 0, 0],
        kind=TaskKind.CHUNK,
        seq=0,
        final=True,
        codes=NdArray.of(np.arange(4, dtype=np.int32).reshape(4, 1)),
    )
    subject = "omni.faults.stage.2.0.in"
    capture.add(subject, None, task.encode())
    capture.add(subject, None, task.replace(codes=None, moved=True, attempt=2).encode())
    assert sent_in_order(capture.sent["r"]).resent_unlike == 0
    capture.add(subject, None, task.replace(codes=None).encode())
    assert sent_in_order(capture.sent["r"]).resent_unlike == 1
