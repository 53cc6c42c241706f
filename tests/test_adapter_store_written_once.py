"""The adapter store is written once: a publish on its subjects adds an
object, never replaces, shadows or removes one; a full store refuses pushes,
saying so; and a fetch turns whatever goes wrong into FetchFailed.

Against a real nats-server, whose stream settings are what refuse; the same
refusals under every role's permissions are in tests/test_store_roles.py.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import nats.js.errors
import pytest
from adapter_dirs import write_adapter
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from store_helpers import store_connection

from lorabus.adapters import fetch as adapter_fetch
from lorabus.adapters.archive import BadArchive
from lorabus.adapters.fetch import fetch_object
from lorabus.adapters.store import object_size, push_adapter
from lorabus.errors import BusError, FetchFailed
from lorabus.schemas import Subjects

MB = 1000 * 1000


@pytest.fixture
def subjects(fleet_name: str) -> Subjects:
    return Subjects(fleet=fleet_name)


@pytest.fixture
async def nc(nats_url: str, subjects: Subjects) -> AsyncIterator[NatsClient]:
    async with store_connection(nats_url, subjects, max_bytes=4 * MB) as connection:
        yield connection


@pytest.fixture
async def pushed(nc: NatsClient, subjects: Subjects, tmp_path: Path) -> str:
    """The digest of an adapter of three chunks, pushed."""
    digest, _ = await push_adapter(
        nc, subjects, str(write_adapter(tmp_path / "a", os.urandom(1_200_000)))
    )
    return digest


def meta_subject(subjects: Subjects, digest: str) -> str:
    return f"$O.{subjects.adapter_store()}.M.{base64.urlsafe_b64encode(digest.encode()).decode()}"


async def stored(nc: NatsClient, subjects: Subjects) -> int:
    info = await nc.jetstream().stream_info(f"OBJ_{subjects.adapter_store()}")
    return int(info.state.messages)


async def fetches(nc: NatsClient, subjects: Subjects, digest: str) -> int:
    return await fetch_object(nc, subjects, digest, io.BytesIO(), timeout_s=10, max_bytes=MB * 4)


async def test_a_second_meta_a_rollup_or_a_deletion_marker_is_refused(
    nc: NatsClient, subjects: Subjects, pushed: str
) -> None:
    js = nc.jetstream()
    meta = json.loads(
        (
            await js.get_last_msg(f"OBJ_{subjects.adapter_store()}", meta_subject(subjects, pushed))
        ).data
    )
    chunks = f"$O.{subjects.adapter_store()}.C.{pushed.removeprefix('sha256:')}.{meta['nuid']}"
    before = await stored(nc, subjects)
    size = await fetches(nc, subjects, pushed)
    forged = json.dumps({**meta, "deleted": True, "size": 0, "chunks": 0}).encode()
    attempts = [
        (meta_subject(subjects, pushed), forged, None),
        (meta_subject(subjects, pushed), forged, {"Nats-Rollup": "sub"}),
        (f"{chunks}.0", b"x", None),
        (f"$O.{subjects.adapter_store()}.C.{'0' * 64}.other.0", b"x", {"Nats-Rollup": "all"}),
        (f"{chunks}.0", b"x", {"Nats-Rollup": "sub"}),
    ]
    for subject, data, headers in attempts:
        with pytest.raises(nats.js.errors.APIError):
            await js.publish(subject, data, headers=headers)

    assert await stored(nc, subjects) == before
    assert await fetches(nc, subjects, pushed) == size


async def test_a_chunk_stored_after_an_object_is_no_part_of_it(
    nc: NatsClient, subjects: Subjects, pushed: str
) -> None:
    """Subjects past the last chunk are free to publish on; a reader takes
    chunk i as the i-th and nothing else."""
    js = nc.jetstream()
    meta = json.loads(
        (
            await js.get_last_msg(f"OBJ_{subjects.adapter_store()}", meta_subject(subjects, pushed))
        ).data
    )
    size = await fetches(nc, subjects, pushed)
    chunks = f"$O.{subjects.adapter_store()}.C.{pushed.removeprefix('sha256:')}.{meta['nuid']}"
    await js.publish(f"{chunks}.{meta['chunks']}", b"more")
    await js.publish(f"{chunks}.x", b"more")

    assert await fetches(nc, subjects, pushed) == size


async def test_a_push_into_a_full_store_fails_saying_so(
    nc: NatsClient, subjects: Subjects, pushed: str, tmp_path: Path
) -> None:
    before = await stored(nc, subjects)
    big = write_adapter(tmp_path / "big", os.urandom(3 * MB))
    with pytest.raises(BusError, match=r"adapter store .* is full .*lorabus adapter list"):
        await push_adapter(nc, subjects, str(big))
    assert await object_size(nc, subjects, pushed) is not None
    assert await stored(nc, subjects) >= before  # what was there stays


def _message(nc: NatsClient, subject: str, data: bytes, headers: dict[str, str]) -> Msg:
    return Msg(_client=nc, subject="_INBOX.x", data=data, headers=headers)


class _Refuses:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def write(self, data: bytes, /) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (BadArchive("not a valid adapter archive: a bad header"), "no adapter: not a valid"),
        (OSError(28, "No space left on device"), "No space left"),
        (ValueError("odd"), "odd"),
    ],
)
async def test_a_sink_that_refuses_fails_the_fetch_as_fetch_failed(
    nc: NatsClient, subjects: Subjects, pushed: str, error: Exception, said: str
) -> None:
    with pytest.raises(FetchFailed, match=f"{pushed}.*{said}"):
        await fetch_object(nc, subjects, pushed, _Refuses(error), timeout_s=10, max_bytes=MB * 4)


@pytest.mark.parametrize("sequence", ["", "x", "-"])
async def test_a_chunk_without_a_valid_sequence_fails_the_fetch_as_fetch_failed(
    nc: NatsClient,
    subjects: Subjects,
    pushed: str,
    monkeypatch: pytest.MonkeyPatch,
    sequence: str,
) -> None:
    """A reply whose sequence header does not parse (a broken server, a
    proxy) ends the fetch with FetchFailed, as anything else does."""

    async def answered(*args: object) -> list[Msg]:
        return [_message(nc, "x", b"chunk", {"Nats-Sequence": sequence})]

    monkeypatch.setattr(adapter_fetch, "_batch", answered)
    with pytest.raises(FetchFailed, match=pushed):
        await fetches(nc, subjects, pushed)
