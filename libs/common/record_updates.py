"""Reads and compare-and-set updates of a request's record in ``omni_requests``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from libs.common.publish import NOT_NOW, STORE_RETRY_MAX_S, STORE_RETRY_S
from libs.common.records import RequestRecord

KV_RETRIES = 5


async def update_record(kv: KeyValue, key: str, change: Callable[[RequestRecord], bool | None]) -> bool:
    """Compare-and-set ``change`` of a record (False from it: no write); False without a record."""
    for _ in range(KV_RETRIES):
        try:
            entry = await kv.get(key)
        except (NotFoundError, KeyError):
            return False
        rec = RequestRecord.model_validate_json(entry.value)
        if change(rec) is False:
            return True
        try:
            await kv.update(key, rec.model_dump_json().encode(), last=entry.revision)
            return True
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"record {key}: too many concurrent updates")


async def read_record(kv: KeyValue, key: str, deadline_ns: int) -> RequestRecord | None:
    """The record ``key`` as stored now, or None. A read the broker does not answer
    (``publish.NOT_NOW``) is tried again with ``publish``'s backoff while the retry would start
    before ``deadline_ns`` (wall clock); past it, the read's error is raised."""
    wait_s = STORE_RETRY_S
    while True:
        try:
            entry = await kv.get(key)
        except (NotFoundError, KeyError):
            return None
        except NOT_NOW:
            if time.time_ns() + wait_s * 1e9 > deadline_ns:
                raise
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, STORE_RETRY_MAX_S)
            continue
        return None if entry.value is None else RequestRecord.model_validate_json(entry.value)
