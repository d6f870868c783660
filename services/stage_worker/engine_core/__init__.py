"""Code that runs inside vLLM's engine processes, not in the worker process.

vLLM starts an ``AsyncLLM``'s engine as a process of its own (``VLLM::EngineCore``, which runs
the model itself, or spawns a ``VLLM::Worker`` for it where vLLM's multiprocessing executor is
used: :mod:`services.stage_worker.engine_executor`). The worker names this package's code to
vLLM by string, and vLLM imports it there:

- :mod:`.scheduler` — ``OmniScheduler`` (``AsyncEngineArgs(scheduler_cls=...)``): the loss-free
  1 Hz scheduler-stats throttle and the hooks of engine tracing; EngineCore process.
- :mod:`.journey_tracing`, :mod:`.step_tracing`, :mod:`.kv_observability` — the journey events,
  ``scheduler_steps`` span and read-only KV helpers (docs/contract.md, "Tracing"), driven by the
  scheduler.
- :mod:`.tracing_config` — the tracing settings that travel from the worker in
  ``additional_config`` and the samplers; read on both sides of the process boundary.
- :mod:`.frame_logits` — the per-position constraint of a talker's codec frames (a vLLM v1 logits
  processor, ``AsyncEngineArgs(logits_processors=...)``, for the ``orpheus`` talker protocol); the
  process that samples.
- :mod:`.wait_plugin` — how the engine processes wait on their queues (a ``vllm.general_plugins``
  entry point, loaded by vLLM in EngineCore and Worker alike).

What it may import: the standard library, vLLM, OpenTelemetry and its own modules. Nothing else of
omnirelay: not the worker process's modules (bus, handlers, request contexts, metrics), whose state
does not exist in this process, and not ``libs`` (NATS clients and service settings have no business
in an engine). The worker process imports this package, never the other way round; an
``import-linter`` contract in ``pyproject.toml`` keeps it so.
"""
