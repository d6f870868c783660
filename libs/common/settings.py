"""Service settings read from the environment (pydantic-settings); CLI flags override them.

Every variable is ``OMNIRELAY_<FIELD>`` except the NATS address, which also honours the
conventional ``NATS_URL``.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from libs.common.bus import LIMITS, BusLimits, server_urls
from libs.common.nats_credentials import NatsCredentials
from libs.common.pipeline import DEFAULT_PIPELINE_PATH

SchedBatch = Annotated[
    bool, Field(description="run as SCHED_BATCH: no preemption on wake-up (runtime.yield_on_wakeup)")
]


def _instance_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:6]}".replace("_", "-")


class ServiceSettings(NatsCredentials):
    """Settings shared by every service (with its NATS identity and TLS: :class:`NatsCredentials`)."""

    model_config = SettingsConfigDict(env_prefix="OMNIRELAY_", extra="ignore")

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        validation_alias=AliasChoices("NATS_URL", "OMNIRELAY_NATS_URL"),
        description="NATS server with JetStream, or every server of a JetStream cluster, comma-separated",
    )
    pipeline: Path = Field(default=DEFAULT_PIPELINE_PATH, description="pipeline YAML file")
    log_stats: bool = Field(default=False, description="record metrics and stats log lines")
    log_level: str = Field(default="INFO", description="Python logging level")
    advertise_host: str = Field(default="127.0.0.1", description="host name others reach this one by")
    instance_id: str = Field(default_factory=_instance_id, description="unique id of this process")
    ack_wait_s: float = Field(default=30.0, gt=0, description="redelivery timer of its consumers, seconds")

    @field_validator("nats_url")
    @classmethod
    def _has_a_server(cls, value: str) -> str:
        server_urls(value)
        return value

    @property
    def bus_limits(self) -> BusLimits:
        return replace(LIMITS, ack_wait_s=self.ack_wait_s)


class GatewaySettings(ServiceSettings):
    """The gateway's settings; docs/security.md says what each control guards against."""

    host: str = Field(default="127.0.0.1", description="HTTP bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (the OpenAI API, /health)")
    admin_port: int = Field(
        default=8001, ge=0, le=65535, description="/metrics and /prometheus/targets, no API key (0: any free)"
    )
    metrics_host: str = Field(default="127.0.0.1", description="admin port's bind address")
    sched_batch: SchedBatch = True
    api_keys: str = Field(default="", description="API keys (Authorization: Bearer), comma-separated")
    api_keys_file: Path | None = Field(default=None, description="API keys, one per line (# comments)")
    generate_api_key: bool = Field(default=False, description="no key set: write a new one to api_keys_file")
    allow_no_auth: bool = Field(default=False, description="UNSAFE: no API keys on a non-loopback address")
    gateway_docs: bool = Field(default=False, description="serve /docs, /redoc and /openapi.json")
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="largest request body, bytes (413)")
    max_headers: int = Field(default=100, ge=10, description="most headers in a request (431 above)")
    max_header_bytes: int = Field(default=16 << 10, ge=1024, description="largest request head, bytes (431)")
    request_head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request's head must arrive within this of the connection's start, seconds",
    )
    keep_alive_s: int = Field(default=5, ge=1, description="idle keep-alive connections close after this, s")
    max_messages: int = Field(default=1024, ge=1, description="most messages in a chat request")
    max_prompt_chars: int = Field(default=500_000, ge=1, description="most characters of a request's prompt")
    max_stop: int = Field(default=4, ge=0, description="most stop sequences in a request (OpenAI's limit)")
    max_tokens_limit: int = Field(
        default=8192, ge=1, description="most tokens a request may generate (and the default max_tokens' cap)"
    )
    allow_ignore_eos: bool | None = Field(default=None, description="allow ignore_eos (unset: loopback only)")
    max_buffered_events: int = Field(
        default=1024, ge=0, description="events a slow reader may leave waiting for 1 s (8 × at once); 0: any"
    )
    slow_reader_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a response write the client does not take within this aborts it, seconds",
    )
    max_realtime_sessions_per_key: int = Field(
        default=16, ge=0, description="realtime sessions one API key may hold open at once; 0: no limit"
    )
    max_concurrent_per_key: int = Field(
        default=256,
        ge=0,
        description="requests one API key (or client address without keys) may run at once; 0: no limit",
    )

    @field_validator("admin_port")
    @classmethod
    def _not_the_public_port(cls, value: int, info: ValidationInfo) -> int:
        if value and value == info.data.get("port"):
            raise ValueError(f"the admin port must differ from the public port ({value})")
        return value


class _BackendSettings(ServiceSettings):
    """The orchestrator's and the workers' own ``/metrics`` listener and stats log line."""

    metrics_port: int = Field(default=0, ge=0, le=65535, description="/metrics port (0: any free)")
    metrics_host: str = Field(default="127.0.0.1", description="/metrics bind address (0.0.0.0: all)")
    log_stats_interval_s: float = Field(default=5.0, gt=0, description="stats log line period, seconds")


class OrchestratorSettings(_BackendSettings):
    sched_batch: SchedBatch = True


class WorkerSettings(_BackendSettings):
    stage: int = Field(default=0, ge=0, description="stage id (0-based position in the pipeline)")
    replica: int = Field(default=0, ge=0, description="replica id of this stage")
    max_inflight: int = Field(default=128, ge=1, description="requests handled at once")
    engine_nice: int = Field(default=10, ge=0, le=19, description="nice value of the engine's threads")
    journey_tracing_sample_rate: float = Field(
        default=1.0, ge=0, le=1, description="share of requests whose engine journey events are traced"
    )
    step_tracing_enabled: bool = Field(default=False, description="emit scheduler step spans/events")
    step_tracing_sample_rate: float = Field(
        default=0.01, ge=0, le=1, description="share of scheduler steps with a step.BATCH_SUMMARY event"
    )
    step_tracing_rich_subsample_rate: float = Field(
        default=0.001,
        ge=0,
        le=1,
        description="share of summarized steps that also get step.REQUEST_SNAPSHOT events",
    )
