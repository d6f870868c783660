"""``libs.common.bus.bucket_keys`` lists every key of a KV bucket while the keys are being written,
against a real nats-server. nats-py's ``KeyValue.keys()`` stops at the first delivery that reports
nothing pending, which under concurrent writes can come before the last key, or before the first
(nats-io/nats.py#995): a snapshot of the registry once left out the talker while every service
was beating (``test_tracing``, a CI run of 2026-11-29)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import nats
import pytest
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from libs.common.bus import bucket_keys

pytestmark = pytest.mark.integration

KEYS = 40
"""Keys in the bucket, each rewritten by its own writer (as every service writes its heartbeat)."""
LISTINGS = 200
"""Listings made while the writers write; nats-py's own came back short in about one of eight of
them on this box (24 of 200)."""


async def test_every_key_is_listed_while_every_key_is_written(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(bucket="listed_while_written", history=1)
    keys = {f"service.{i}" for i in range(KEYS)}
    for key in keys:
        await kv.put(key, b"first")
    writing = True
    writes = itertools.count()

    async def writer(key: str) -> None:
        while writing:
            await kv.put(key, b"again" * 40)
            next(writes)
            await asyncio.sleep(0.005)

    writers = [asyncio.create_task(writer(k)) for k in sorted(keys)]
    short, theirs_short = [], 0
    try:
        for _ in range(LISTINGS):
            listed = await bucket_keys(nc, "listed_while_written")
            if listed != keys:
                short.append(sorted(keys - listed))
            with contextlib.suppress(NoKeysError):  # raised with every key there: counted short
                if set(await kv.keys()) == keys:
                    continue
            theirs_short += 1
    finally:
        writing = False
        await asyncio.gather(*writers)
        await nc.close()
    rewritten = next(writes)
    # the fault: the keys were rewritten while they were listed, many times over
    assert rewritten >= 10 * KEYS, f"only {rewritten} writes during {LISTINGS} listings"
    assert short == [], (
        f"{len(short)} of {LISTINGS} listings left keys out (nats-py's keys(): {theirs_short})"
    )


async def test_a_deleted_key_is_listed_and_reads_as_gone(nats_server) -> None:
    """A delete leaves a marker on the key's subject: the key is listed, and a get says it is gone
    (``bus_state`` skips it)."""
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="listed_after_delete", history=1)
        for key in ("kept", "deleted"):
            await kv.put(key, b"x")
        await kv.delete("deleted")
        assert await bucket_keys(nc, "listed_after_delete") == {"kept", "deleted"}
        with pytest.raises(KeyNotFoundError):
            await kv.get("deleted")
        await kv.purge("kept")
        assert await bucket_keys(nc, "listed_after_delete") == {"kept", "deleted"}
    finally:
        await nc.close()


async def test_an_empty_bucket_lists_nothing_and_a_missing_one_raises(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(bucket="listed_empty", history=1)
        assert await bucket_keys(nc, "listed_empty") == set()
        with pytest.raises(NotFoundError):
            await bucket_keys(nc, "never_made")
    finally:
        await nc.close()
