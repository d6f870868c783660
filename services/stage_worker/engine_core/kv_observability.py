"""Read-only KV-cache figures for tracing (docs/contract.md, "Tracing"), from interfaces vLLM already has.

Nothing here allocates, frees, touches a block or adds bookkeeping: the functions read the
``KVCacheManager``'s per-group managers (``coordinator.single_type_managers``: ``req_to_blocks``,
``num_cached_block``), the ``BlockPool`` (``num_gpu_blocks``, ``get_num_free_blocks()``,
``get_usage()``) and existing ``Request`` fields. They never raise: a figure that cannot be read
comes back as 0 (guaranteed fields) or ``None`` (optional fields).

What vLLM 0.32 exposes, and so what is guaranteed:

- per request: blocks held in the GPU pool (summed over KV-cache groups) and, of those, the
  blocks registered in the prefix cache (``num_cached_block``: prefix-cache hits plus the
  request's own full blocks once cached — vLLM keeps one counter for both);
- per step: pool size (minus the reserved null block), free blocks, usage ratio.

Optional, ``None`` on this vLLM: CPU/disk offload counts (the offloading connector keeps no
per-request or per-pool count the scheduler can read cheaply) and ``effective_prompt_len`` once
the request's prefill stats have been handed to the frontend (``Request.num_cached_tokens`` does
not exist in 0.32; ``Request.prefill_stats`` holds the cached-token count until the first output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.omnirelay.kv_observability")
"""Under ``vllm.``: vLLM's logging set-up prints it in the EngineCore, prefixed with the process."""


@dataclass(frozen=True, slots=True)
class PerRequestKVMetrics:
    """One request's KV-cache footprint.

    Guaranteed: ``blocks_allocated_gpu`` (blocks the request holds in the GPU pool, all groups),
    ``blocks_cached_gpu`` (of those, blocks registered in the prefix cache; never more than
    allocated). Optional (``None`` when not readable): offload counts, ``effective_prompt_len``
    (prompt tokens left to compute after prefix-cache/external hits).
    """

    blocks_allocated_gpu: int
    blocks_cached_gpu: int
    blocks_cpu_offload: int | None = None
    blocks_disk_offload: int | None = None
    effective_prompt_len: int | None = None


@dataclass(frozen=True, slots=True)
class StepKVSummary:
    """The GPU KV pool at one scheduler step.

    Guaranteed: ``blocks_total_gpu`` (pool size minus the null block), ``blocks_free_gpu``,
    ``usage_gpu_ratio`` in [0, 1]. Optional: offload counts.
    """

    blocks_total_gpu: int
    blocks_free_gpu: int
    usage_gpu_ratio: float
    blocks_cpu_offload: int | None = None
    blocks_disk_offload: int | None = None


def _effective_prompt_len(request: Any) -> int | None:
    prompt = getattr(request, "num_prompt_tokens", None)
    if not isinstance(prompt, int):
        return None
    cached = getattr(request, "num_cached_tokens", None)  # newer vLLM versions
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        stats = getattr(request, "prefill_stats", None)
        # PrefillStats is filled at first admission (num_prompt_tokens > 0) and handed to the
        # frontend with the first output (the request's field becomes None).
        if stats is None or not getattr(stats, "num_prompt_tokens", 0):
            return None
        cached = stats.num_cached_tokens
    return max(prompt - cached, 0)


def get_per_request_kv_metrics(request: Any, manager: Any) -> PerRequestKVMetrics:
    """``request``'s KV figures from ``manager`` (a ``KVCacheManager``); zeros if unreadable."""
    try:
        rid = request.request_id
        allocated = cached = 0
        for group in manager.coordinator.single_type_managers:
            # .get: req_to_blocks is a defaultdict, indexing would insert an entry.
            n_blocks = len(group.req_to_blocks.get(rid, ()))
            allocated += n_blocks
            cached += min(group.num_cached_block.get(rid, 0), n_blocks)
        return PerRequestKVMetrics(
            blocks_allocated_gpu=allocated,
            blocks_cached_gpu=cached,
            effective_prompt_len=_effective_prompt_len(request),
        )
    except Exception as e:
        log.debug("KV metrics of request %s unavailable: %s", getattr(request, "request_id", "?"), e)
        return PerRequestKVMetrics(blocks_allocated_gpu=0, blocks_cached_gpu=0)


def get_step_kv_summary(block_pool: Any) -> StepKVSummary:
    """The pool's size, free blocks and usage (``BlockPool`` methods); zeros if unreadable."""
    try:
        total = max(int(block_pool.num_gpu_blocks) - 1, 0)  # the null block is never allocatable
        free = min(max(int(block_pool.get_num_free_blocks()), 0), total)
        usage = min(max(float(block_pool.get_usage()), 0.0), 1.0)
        return StepKVSummary(blocks_total_gpu=total, blocks_free_gpu=free, usage_gpu_ratio=usage)
    except Exception as e:
        log.debug("KV pool summary unavailable: %s", e)
        return StepKVSummary(blocks_total_gpu=0, blocks_free_gpu=0, usage_gpu_ratio=0.0)
