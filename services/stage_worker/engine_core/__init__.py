"""Code that runs inside vLLM's engine processes (``VLLM::EngineCore`` and its ``VLLM::Worker``),
not in the worker process; the worker names it to vLLM by string:

- :mod:`.scheduler` — ``OmniScheduler``: the scheduler-stats throttle and the engine tracing hooks
  (:mod:`.journey_tracing`, :mod:`.step_tracing`, :mod:`.kv_observability`, :mod:`.tracing_config`);
- :mod:`.frame_logits` — the per-position constraint of a talker's codec frames (a logits processor);
- :mod:`.plugin` — the vLLM general plugin: :mod:`.wait_plugin` and :mod:`.parent_death`.

It may import the standard library, vLLM, OpenTelemetry and its own modules, nothing else of
omnirelay: the worker process imports this package, never the other way round (an
``import-linter`` contract in ``pyproject.toml`` keeps it so).
"""
