"""Compare-and-set updates of a request's record in ``omni_requests`` (the record model itself is
:mod:`libs.common.records`): several orchestrators, and a talker writing its position notes, may
change one record at once."""

from __future__ import annotations

from collections.abc import Callable

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from libs.common.records import RequestRecord

KV_RETRIES = 5


async def update_record(kv: KeyValue, key: str, change: Callable[[RequestRecord], bool | None]) -> bool:
    """Read-modify-write of a record with optimistic concurrency (several writers);
    False when there is no such record. A ``change`` that returns False leaves it as it is."""
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
