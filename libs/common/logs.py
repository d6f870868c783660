"""Logging set-up shared by the services: one line per record, prefixed with the service identity."""

from __future__ import annotations

import logging


def setup_logging(level: str, prefix: str) -> None:
    """Configure the root logger: ``<time> <level> [<prefix>] <logger>: <message>``."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{prefix}] %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
