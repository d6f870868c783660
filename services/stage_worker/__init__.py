"""The stage worker: one process per (stage, replica), and the engine processes vLLM starts for it.

Worker process (``omnirelay worker``):

- :mod:`.worker` — the bus side: the stage's pull consumer, admission of tasks into requests,
  heartbeats, aborts, the request's span, the terminal event;
- :mod:`.inbox`, :mod:`.request_context` — one request's ordered inputs and its outputs (client
  events, downstream chunks, lifecycle events); :mod:`.chunking` — how outputs are cut into chunks;
  :mod:`.transfer_stats` — the per-hop transfer metrics of what arrives;
- :mod:`.handlers` — what each stage kind computes (thinker, talker, code2wav);
- :mod:`.llm_engine` — how an ``llm`` stage's ``AsyncLLM`` is built; :mod:`.engine_metrics` — vLLM's
  stat loggers relabelled by stage and replica; :mod:`.engine_processes` — the engine processes'
  CPU and memory on this worker's ``/metrics``.

Engine processes (started by vLLM, see :mod:`.engine_core`): the scheduler subclass, engine tracing
and the engine wait plugin. They import nothing from the worker process.
"""
