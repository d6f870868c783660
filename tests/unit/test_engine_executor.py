"""Where an engine runs its model (services/stage_worker/engine_executor.py): the decision, and the
environment the EngineCore is spawned with, against vLLM's own executor's for the same binding."""

from __future__ import annotations

import os

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
def test_the_core_is_spawned_with_the_openmp_environment_of_vllms_own_worker(
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
