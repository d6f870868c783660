"""A service's identity where an operator meets it: the prefix of its log lines and its title in
``ps``."""

from __future__ import annotations

import logging

import setproctitle


def set_service_identity(level: str, name: str) -> None:
    """Configure the root logger (``<time> <level> [<name>] <logger>: <message>``) and end the
    process title with `` [<name>]`` (``... -m cli worker [thinker-0]``), unless it ends with a
    name already: :mod:`libs.stack.forker` titles a service with its name in the stack's plan."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
    title = setproctitle.getproctitle()
    if not title.endswith("]"):
        setproctitle.setproctitle(f"{title} [{name}]")
