"""The stage worker: one process per (stage, replica) (``omnirelay worker``).

:mod:`.worker` takes the stage's tasks off the bus; :mod:`.request_context` is one request's inputs
and outputs; :mod:`.handlers` compute each stage kind; :mod:`.llm_engine` builds an ``llm`` stage's
``AsyncLLM``. The engine processes vLLM starts run :mod:`.engine_core` and import nothing else.
"""
