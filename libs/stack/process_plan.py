"""The process plan of a stack: which ``omnirelay`` processes run (the orchestrator, one worker per
(stage, replica), the gateway), with which arguments and environment, and the command line that
starts each one.

One plan for every way the stack is run: ``omnirelay up`` (``cli/launcher.py``), the compose file
(``compose/docker-compose.yml``, held to this plan by ``tests/integration/test_compose.py``) and the
fault suite's stack of one supervised process per service (``libs/stack/local_stack.py``). A pure
function of the pipeline and options.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.pipeline import PipelineConfig

SERVICE_IMPORTS = ("cli.main", "services.stage_worker.worker", "vllm.v1.engine.async_llm")
"""What the planned services import that costs time (the CLI, the worker with its engine modules,
vLLM's engine): a stack's forker (:mod:`libs.stack.forker`) imports it before it forks them."""


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack: a name for log prefixes, its ``omnirelay`` arguments and env."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        """The command line that starts it: this Python, ``-m cli``, then :attr:`args` (the
        environment adds :attr:`env` to the parent's)."""
        return [sys.executable, "-m", "cli", *self.args]


def plan_services(
    pipeline: PipelineConfig,
    pipeline_path: Path,
    nats_url: str,
    port: int,
    log_stats: bool,
    admin_port: int = 0,
) -> list[ServiceSpec]:
    """Orchestrator, one worker per (stage, replica), gateway — in start order. The gateway serves
    the OpenAI API on ``port`` and ``/metrics`` with ``/prometheus/targets`` on ``admin_port``
    (0: any free port; its registry record says which)."""
    common = {
        "NATS_URL": nats_url,
        "OMNIRELAY_PIPELINE": str(pipeline_path),
        "OMNIRELAY_LOG_STATS": "true" if log_stats else "false",
    }
    specs = [ServiceSpec("orchestrator", ["orchestrator"], dict(common))]
    for s, stage in enumerate(pipeline.stages):
        for r in range(stage.replicas):
            env = {**common, "OMNIRELAY_STAGE": str(s), "OMNIRELAY_REPLICA": str(r)}
            specs.append(ServiceSpec(f"{stage.name}-{r}", ["worker"], env))
    gateway = {**common, "OMNIRELAY_PORT": str(port), "OMNIRELAY_ADMIN_PORT": str(admin_port)}
    specs.append(ServiceSpec("gateway", ["gateway"], gateway))
    return specs
