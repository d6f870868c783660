"""How a vLLM engine's processes wait for their next message: a vLLM general plugin.

An engine whose model runs in a process of its own (EngineCore and its Worker) passes each step
through shared-memory queues whose reader, after every message, busy-waits with ``sched_yield`` for
a second (vLLM's ``SpinCondition.busy_loop_s``) before it sleeps on a ZeroMQ notification. On a CPU
box with more engines than cores that burns the cores the other engines need
(``results/pipeline/2026-12-06-engine-wait.md``).

:class:`WaitPolicy` keeps the busy wait for ``spin_s`` after a read, then, for the rest of vLLM's
busy window, checks the queue every ``nap_s`` seconds and sleeps in between; past the window vLLM's
own idle wait takes over. It travels in the environment (:meth:`WaitPolicy.env`, set by the worker);
without those variables :func:`register` changes nothing.
"""

from __future__ import annotations

import os
import time
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
    if SPIN_ENV in os.environ and NAP_ENV in os.environ:
        install(WaitPolicy(float(os.environ[SPIN_ENV]), float(os.environ[NAP_ENV])))
