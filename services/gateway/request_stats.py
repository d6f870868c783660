"""What the gateway saw of one request, and the logger that turns it into pipeline and audio metrics.

Every time here is ``time.monotonic()`` of the gateway process, so each interval comes from one
clock. The anchor is the HTTP arrival, stamped by the ASGI middleware before anything else runs
(the same moment as ``Omni-Arrival-Ns`` on the wall clock). "Written" means handed to the ASGI
server for sending to the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.bus_trust import Rejected, rejection_counter
from libs.common.metrics_catalog import CONTINUITY_THRESHOLDS_MS, MetricSet
from libs.common.playback import AudioChunk, simulate_playback

PCM16_WIDTH = 2
CODEC_REJECTED = "codec_input_rejected"


def _id(v: int | None) -> str:
    return "" if v is None else str(v)


@dataclass
class RequestStats:
    arrival_s: float
    audio: bool
    streamed: bool
    started_s: float | None = None
    """First event from the pipeline (the request left the waiting state)."""
    finished_reason: str | None = None
    failure: str | None = None
    """Error code when the request failed (timeout, stage_error, ...)."""
    audio_stage: int | None = None
    audio_replica: int | None = None
    sample_rate: int = 0
    audio_chunks: list[AudioChunk] = field(default_factory=list)
    """Streaming: each audio chunk when written; non-streaming: one chunk, the response body."""
    audio_bytes: int = 0
    last_audio_received_s: float | None = None
    """When the last audio chunk reached the gateway (end of audio generation as seen here)."""
    stage_gen_s: float | None = None
    """The audio stage's own generation time (first input → last output on its worker's clock),
    from its ``audio_done``; None when that event was made up by the gateway (it was lost)."""
    input_tokens: int = 0
    output_tokens: int = 0
    trace_id: str | None = None
    """The request's trace (an exemplar on the latency histograms), when tracing is on."""
    done: bool = False

    @property
    def exemplar(self) -> dict[str, str] | None:
        return {"trace_id": self.trace_id} if self.trace_id else None

    def audio_stage_ended(self, stage: int, replica: int | None) -> None:
        """A stage after the thinker ended the request (``audio_done``, or an error): the audio
        families' ``stage`` and ``replica`` of a request that got no audio (a skipped one)."""
        if self.audio_stage is None:
            self.audio_stage, self.audio_replica = stage, replica

    def audio_received(
        self, stage: int | None, replica: int | None, nbytes: int, sample_rate: int, now: float
    ) -> None:
        self.audio_stage, self.audio_replica = stage, replica
        self.audio_bytes += nbytes
        self.sample_rate = sample_rate or self.sample_rate
        self.last_audio_received_s = now


class GatewayStatLogger:
    """Consumes :class:`RequestStats` at three moments: submitted, started, ended."""

    def __init__(self, metrics: MetricSet, model_name: str) -> None:
        self._m = metrics
        self._model = model_name
        self.bus_rejected: Callable[[Rejected], None] = rejection_counter(metrics, model_name)
        """Count a bus message dropped as stale or forged (:mod:`services.gateway.event_trust`)."""

    def submitted(self, s: RequestStats) -> None:
        if self._m.enabled:
            self._m["vllm:omni_num_requests_waiting"].labels(self._model).inc()

    def started(self, s: RequestStats, now: float) -> None:
        if s.started_s is not None:
            return
        s.started_s = now
        if self._m.enabled:
            self._m["vllm:omni_num_requests_waiting"].labels(self._model).dec()
            self._m["vllm:omni_num_requests_running"].labels(self._model).inc()

    def realtime_sessions(self, delta: int) -> None:
        """A realtime session opened (+1) or closed (-1)."""
        if self._m.enabled:
            self._m["vllm:omni_realtime_sessions"].labels(self._model).inc(delta)

    def voice_to_voice(self, seconds: float) -> None:
        """A realtime turn's end of speech → its response's first audio delta, seconds."""
        if self._m.enabled:
            self._m["vllm:omni_realtime_voice_to_voice_s"].labels(self._model).observe(seconds)

    def interrupted(self, cause: str) -> None:
        """A realtime response was cancelled (``cause``: turn_detected or client_cancelled)."""
        if self._m.enabled:
            self._m["vllm:omni_realtime_interruptions"].labels(self._model, cause).inc()

    def stale_event(self, stage: int) -> None:
        """An event of an attempt the request had moved past was dropped."""
        if self._m.enabled:
            self._m["vllm:omni_stale_events_dropped"].labels(self._model, str(stage)).inc()

    def event_gap(self, stage: int) -> None:
        """Events of a stage were found missing (lost on the way to the gateway)."""
        if self._m.enabled:
            self._m["vllm:omni_client_event_gaps"].labels(self._model, str(stage)).inc()

    def slow_reader(self) -> None:
        """A streamed response was aborted: its client read too slowly."""
        if self._m.enabled:
            self._m["vllm:omni_slow_reader_aborts"].labels(self._model).inc()

    def rejected(self, reason: str) -> None:
        """A request that could not even be queued (queue full, bus down)."""
        if self._m.enabled:
            self._m["vllm:omni_requests_failed"].labels(self._model, reason).inc()

    def ended(self, s: RequestStats, end_s: float) -> None:
        """Record a request once, when its last byte was written or it was abandoned."""
        if s.done:
            return
        s.done = True
        if not self._m.enabled:
            return
        m, model = self._m, self._model
        gauge = "vllm:omni_num_requests_waiting" if s.started_s is None else "vllm:omni_num_requests_running"
        m[gauge].labels(model).dec()
        if s.failure is not None:
            m["vllm:omni_requests_failed"].labels(model, s.failure).inc()
        else:
            reason = s.finished_reason or "stop"
            m["vllm:omni_requests_success"].labels(model, reason).inc()
            if reason != "abort":  # an abandoned request has no end-to-end latency
                m["vllm:omni_e2e_request_latency_s"].labels(model).observe(end_s - s.arrival_s, s.exemplar)
        if s.audio:
            self._audio(s)

    def _audio(self, s: RequestStats) -> None:
        m = self._m
        labels = (self._model, _id(s.audio_stage), _id(s.audio_replica))
        if not s.audio_bytes or not s.audio_chunks:
            # Silent loss: the request ended without audio. Other failures are counted as failures.
            if s.failure is None or s.failure == CODEC_REJECTED:
                m["vllm:omni_audio_skipped_requests"].labels(*labels, s.failure or "no_audio_data").inc()
            return
        frames = s.audio_bytes // PCM16_WIDTH
        duration = frames / s.sample_rate
        m["vllm:omni_audio_frames"].labels(*labels).inc(frames)
        m["vllm:omni_audio_duration_s"].labels(*labels).observe(duration)
        m["vllm:omni_audio_ttfp_s"].labels(*labels).observe(s.audio_chunks[0].t_s - s.arrival_s, s.exemplar)
        if s.stage_gen_s is not None and duration > 0:
            m["vllm:omni_audio_rtf"].labels(*labels).observe(s.stage_gen_s / duration)
        if s.last_audio_received_s is not None and duration > 0:
            m["vllm:omni_audio_client_rtf"].labels(*labels).observe(
                (s.last_audio_received_s - s.arrival_s) / duration
            )
        if s.streamed:
            play = simulate_playback(s.audio_chunks, s.sample_rate, PCM16_WIDTH)
            m["vllm:omni_audio_streams"].labels(*labels).inc()
            m["vllm:omni_audio_underrun_s"].labels(*labels).observe(play.worst_underrun_s)
            if play.late_chunks:
                m["vllm:omni_audio_late_chunks"].labels(*labels).inc(play.late_chunks)
            for ms in CONTINUITY_THRESHOLDS_MS:
                if play.worst_underrun_s < ms / 1000:
                    m["vllm:omni_audio_continuity_ok"].labels(*labels, str(ms)).inc()
