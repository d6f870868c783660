"""Where an engine runs its model (services/stage_worker/engine_executor.py): the decision, the
environment the EngineCore starts with, against vLLM's own executor's for the same binding, and the
forked core's binding."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket

import pytest

from services.stage_worker.engine_executor import EXECUTOR_ARG, model_in_engine_core, one_process_engine


@pytest.mark.parametrize(
    ("on_cpu", "world_size", "args", "inside"),
    [
        (True, 1, {}, True),
        (True, 1, {"max_num_seqs": 4}, True),
        (True, 1, {EXECUTOR_ARG: "mp"}, False),  # the stage names vLLM's executor: kept
        (True, 1, {EXECUTOR_ARG: "uni"}, False),  # ... whichever it names
        (True, 2, {}, False),  # tensor parallel: one process per rank, as vLLM runs it
        (False, 1, {}, False),  # a GPU: vLLM's own default for one device already
    ],
)
def test_only_a_one_rank_cpu_engine_whose_stage_names_no_executor_runs_its_model_in_the_core(
    on_cpu: bool, world_size: int, args: dict[str, object], inside: bool
) -> None:
    assert model_in_engine_core(on_cpu, world_size, args) is inside


def _config():
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig())


@pytest.mark.parametrize("bind", ["1", "0-1", "nobind"])
def test_the_core_starts_with_the_openmp_environment_of_vllms_own_worker(
    monkeypatch: pytest.MonkeyPatch, bind: str
) -> None:
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    names = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    for name in names:
        monkeypatch.setenv(name, "before")
    config = _config()
    with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
        vllms = {n: os.environ[n] for n in names}
    with one_process_engine(config):
        inside = {n: os.environ[n] for n in names}
        assert config.parallel_config.distributed_executor_backend is UniProcExecutor
    assert inside == vllms
    if bind == "nobind":
        assert set(inside.values()) == {"before"}
    else:  # the thread count and one of the OpenMP runtimes' binding variables, by LD_PRELOAD
        assert inside["OMP_NUM_THREADS"] == str(len(bind.replace("-", ",").split(",")))
        assert any(inside[n] != "before" for n in ("OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY"))
    assert {n: os.environ[n] for n in names} == dict.fromkeys(names, "before")  # restored


def _report(out: multiprocessing.SimpleQueue) -> None:
    import torch

    out.put((sorted(os.sched_getaffinity(0)), torch.get_num_threads(), signal.set_wakeup_fd(-1)))


def test_a_forked_core_binds_itself_to_its_cores_and_leaves_the_workers_wakeup_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM forks the core inside the block (as it does from an ``AsyncLLM``): the child runs on
    the bound core with one thread per core, and no longer signals the worker's event loop."""
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cores[-1]))
    config = _config()
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    previous = signal.set_wakeup_fd(ours.fileno())
    try:
        with one_process_engine(config):
            child = ctx.Process(target=_report, args=(out,))
            child.start()
            child.join(30)
    finally:
        signal.set_wakeup_fd(previous)
        ours.close()
        theirs.close()
    assert child.exitcode == 0
    assert out.get() == ([cores[-1]], 1, -1)
    assert sorted(os.sched_getaffinity(0)) == cores  # the test process itself is left unbound
