"""Tenant ``a`` attacks tenant ``b`` on a real nats-server started from
``lorabus auth init --tenant``'s configuration (static accounts, and the
operator/JWT form), every part as its own identity.

What the server's permissions keep ``a`` from: publishing on ``b``'s
subjects, on the generic orchestrator's, on the operator's reset, hearing
heartbeats, reading any store but for the meta record of its own a push
checks, writing into ``b``'s store or the fleet's, filling its own past its
quota of bytes. What the coordinator holds ``a`` to, from the subject it
asked on: ``b``'s adapters, objects and results, its own quotas. Meanwhile
``b``'s pushes and updates go through, and every refusal is in the audit
trail. (Removing or replacing an object of the store as a tenant:
test_store_roles.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from secured import watched

from lorabus.audit.tap import Tap, TrailRecord, decode_message
from lorabus.errors import BusError
from lorabus.schemas import (
    UNKNOWN,
    ErrorCode,
    RequestRefused,
    ResetRequest,
    Subjects,
    UpdateRequest,
    encode,
)
from lorabus.security.roles import FLEET_JS_API, Role
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter


async def test_a_tenant_cannot_reach_another_tenants_adapters(
    secured_stack: EmbeddedStack, make_adapter: Callable[[int], str], tmp_path: Path
) -> None:
    stack = secured_stack
    subjects = Subjects(fleet=stack.fleet_name)
    a, b = await stack.client_as("a"), await stack.client_as("b")
    refusals: list[RequestRefused] = []

    async def on_record(record: TrailRecord) -> None:
        if not record.poison and isinstance(event := decode_message(record), RequestRefused):
            refusals.append(event)

    auditor = await stack.bus_as(Role.AUDITOR).connect("test-auditor")
    following = asyncio.create_task(Tap(auditor, subjects).run(on_record, follow=True))
    try:
        # b pushes its adapter as itself, into its own store, and commits it.
        digest = await b.push_adapter(make_adapter(1))
        theirs = await b.update("b-policy", digest=digest, version=1, timeout_s=30)
        assert theirs.committed, theirs.error
        # a names b's object: its own adapter from b's bytes, by b's path.
        aimed = await a.update("a-policy", f"bus:b/{digest}", version=1, timeout_s=30)
        assert aimed.error is not None and aimed.error.code == ErrorCode.FORBIDDEN, aimed
        # By digest alone it names its own store, where b's object is not.
        absent = await a.update("a-policy", digest=digest, version=1, timeout_s=30)
        assert absent.error is not None and absent.error.code == ErrorCode.BAD_REQUEST, absent
        assert "not in the fleet's object store" in absent.error.message

        # On its own subject: b's adapter (an update, a newer version to
        # supersede it), b's result, the fleet's status.
        for version in (1, 2):
            forbidden = await a.update("b-policy", digest=digest, version=version, timeout_s=30)
            assert forbidden.error is not None, forbidden
            assert forbidden.error.code == ErrorCode.FORBIDDEN, forbidden.error
        hidden = await a.result(theirs.update_id)
        assert hidden.status == UNKNOWN and hidden.adapter == "", hidden
        assert (await a.status()).adapters == []

        # On subjects not its own: refused by the server, and nothing arrives.
        sneaky = encode(
            UpdateRequest(update_id="b:9", adapter="b-policy", path=f"bus:{digest}", version=9)
        )
        reset = encode(ResetRequest(adapter="b-policy", reason="mine now"))
        async with watched(stack.bus_as(Role.TENANT, "a")) as raw:
            await raw.nc.subscribe(subjects.heartbeat_any())
            theirs_store = subjects.for_store("b").adapter_store()
            stores = (f"OBJ_{subjects.adapter_store()}", f"OBJ_{theirs_store}")
            meta = f"$O.{theirs_store}.M.x"
            for subject, data in (
                (subjects.tenant_request("b", "update"), sneaky),
                (subjects.update_request(), sneaky),
                (subjects.reset_request(), reset),
                # A store by sequence (b's chunks), and its subjects (b's digests).
                *((f"{FLEET_JS_API}.DIRECT.GET.{s}", b'{"seq": 1}') for s in stores),
                *((f"{FLEET_JS_API}.STREAM.INFO.{s}", b'{"subjects_filter": ">"}') for s in stores),
                # b's meta records, and a chunk or a meta into b's store or the fleet's.
                (f"{FLEET_JS_API}.DIRECT.GET.OBJ_{theirs_store}.{meta}", b""),
                (meta, b"{}"),
                (f"$O.{theirs_store}.C.{digest.removeprefix('sha256:')}.n.0", b"x"),
                (f"$O.{subjects.adapter_store()}.M.x", b"{}"),
            ):
                await raw.nc.publish(subject, data, reply=raw.nc.new_inbox())
                await raw.wait_refusal("publish", subject)
            await raw.wait_refusal("subscription", subjects.heartbeat_any())

        # a's store holds 3 MiB: its second large adapter does not fit, and
        # b's pushes still do (each store is its own tenant's).
        big = tmp_path / "big"
        mine = await a.push_adapter(write_adapter(big, 1, hidden=4096, layers=4))
        with pytest.raises(BusError, match="full"):
            await a.push_adapter(write_adapter(big, 2, hidden=4096, layers=4))
        assert await b.push_adapter(write_adapter(big, 3, hidden=4096, layers=4))

        # A flood of a's own: bounded by its quotas (4 adapters, 2 waiting),
        # while b's next version commits. It starts a second after a's
        # refusals above: each tenant's refusals are audited at most 10 a
        # second, and this test counts every one of them in the trail.
        await asyncio.sleep(1.1)
        flood = [
            asyncio.ensure_future(a.update(f"a-{i}", digest=mine, version=1, timeout_s=60))
            for i in range(12)
        ]
        nxt = await b.update("b-policy", digest=digest, version=2, timeout_s=60)
        assert nxt.committed, nxt.error
        results = await asyncio.gather(*flood)
        codes = [r.error.code if r.error else "committed" for r in results]
        assert codes.count("committed") <= 4, codes
        assert set(codes) <= {"committed", ErrorCode.BUSY, ErrorCode.QUOTA}, codes
        assert ErrorCode.QUOTA in codes or ErrorCode.BUSY in codes, codes
        status = await stack.client.status() if stack.client else None
        assert status is not None
        # (A result names the served name.)
        assert {s.served_name for s in status.adapters if s.adapter.startswith("a-")} == {
            r.adapter for r in results if r.committed
        }
        assert [(s.adapter, s.version) for s in status.adapters if s.adapter == "b-policy"] == [
            ("b-policy", 2)
        ]

        # Every refusal of what a asked is in the trail, naming a.
        quota = codes.count(ErrorCode.QUOTA)
        async with asyncio.timeout(10):
            while len(refusals) < 3 + quota:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert {r.tenant for r in refusals} == {"a"}
        assert sorted(r.error.code for r in refusals) == sorted(
            [ErrorCode.FORBIDDEN] * 3 + [ErrorCode.QUOTA] * quota
        )
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await auditor.close()
