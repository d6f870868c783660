"""The vLLM general plugin of omnirelay (entry point ``vllm.general_plugins`` in
``pyproject.toml``): vLLM calls :func:`register` in each of its processes."""

from __future__ import annotations

from services.stage_worker.engine_core import parent_death, wait_plugin


def register() -> None:
    """How the engine's processes wait (:mod:`.wait_plugin`), and that they die with their parent
    (:mod:`.parent_death`)."""
    wait_plugin.register()
    parent_death.link_to_parent()
