"""Read-only KV-cache figures for tracing, from what vLLM 0.32 already exposes.

Nothing here allocates, frees or touches a block: the functions read the ``KVCacheManager``'s
per-group managers (``req_to_blocks``, ``num_cached_block``), the ``BlockPool`` and ``Request``
fields. They never raise: an unreadable figure is 0 (guaranteed fields) or ``None`` (optional ones:
CPU/disk offload counts, which this vLLM does not keep, and ``effective_prompt_len`` once the
request's prefill stats have gone to the frontend).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.omnirelay.kv_observability")
"""Under ``vllm.``: vLLM's logging set-up prints it in the EngineCore, prefixed with the process."""


@dataclass(frozen=True, slots=True)
class PerRequestKVMetrics:
    """One request's KV-cache footprint: blocks it holds in the GPU pool (all groups), of those the
    blocks registered in the prefix cache; optional: offload counts, ``effective_prompt_len``
    (prompt tokens left to compute after prefix-cache/external hits)."""

    blocks_allocated_gpu: int
    blocks_cached_gpu: int
    blocks_cpu_offload: int | None = None
    blocks_disk_offload: int | None = None
    effective_prompt_len: int | None = None


@dataclass(frozen=True, slots=True)
class StepKVSummary:
    """The GPU KV pool at one scheduler step: size (minus the null block), free blocks, usage in
    [0, 1]; optional: offload counts."""

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
