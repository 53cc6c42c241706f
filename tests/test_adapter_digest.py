"""Replicas load the same bytes: the content digest of an adapter directory,
each agent's digest of what its own host shows at the update's path, and the
coordinator refusing to commit when they differ.

The stale shared filesystem is reproduced for real: one agent runs in a mount
namespace of its own where an older copy of the adapter is bind-mounted over
the update's path, so at the same path it reads other bytes, exactly as a
host with a stale NFS cache or a half-finished rsync would.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from processes import Processes, run_lorabus, wait_live_workers

from lorabus.adapters import digest as digest_module
from lorabus.adapters.digest import MAX_FILES, adapter_digest, read_adapter_digest
from lorabus.agents import AgentConfig, CommandExecutor, DynamoDriver
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.coordinator.digests import digest_problem
from lorabus.schemas import Ack, ErrorCode, ErrorInfo, LoadCommand, Phase
from lorabus.schemas.codec import BadPayload, ack_decoder
from lorabus.simfleet import SimFleet
from lorabus.testbed.trainer import write_adapter

WORKERS = {"w000": 1, "w001": 2}


def _by_the_definition(root: Path) -> str:
    """docs/protocol.md's definition, written out again independently."""
    files = sorted(
        (p.relative_to(root).as_posix().encode(), p.read_bytes())
        for p in root.rglob("*")
        if p.is_file()
    )
    digest = hashlib.sha256()
    for relative, content in files:
        digest.update(relative + b"\0" + len(content).to_bytes(8, "big") + content)
    return "sha256:" + digest.hexdigest()


def test_the_digest_follows_its_definition_and_sees_every_byte(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a", 1)
    (adapter / "nested").mkdir()
    (adapter / "nested" / "extra.bin").write_bytes(b"\x00" * 3)
    first = adapter_digest(adapter)

    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    same_elsewhere = adapter_digest(copy)
    (copy / "nested" / "extra.bin").write_bytes(b"\x00" * 2 + b"\x01")
    one_byte_changed = adapter_digest(copy)
    (copy / "nested" / "extra.bin").rename(copy / "nested" / "other.bin")
    renamed = adapter_digest(copy)

    assert first == _by_the_definition(adapter)
    assert first.startswith("sha256:") and len(first) == 71
    assert same_elsewhere == first, "the directory's own path is not part of it"
    assert len({first, one_byte_changed, renamed}) == 3


def test_what_cannot_be_hashed_is_refused(tmp_path: Path) -> None:
    many = tmp_path / "many"
    many.mkdir()
    for i in range(MAX_FILES + 1):
        (many / f"f{i}").touch()

    with pytest.raises(ValueError, match="not a directory"):
        adapter_digest(tmp_path / "missing")
    with pytest.raises(ValueError, match="more than"):
        adapter_digest(many)


def _ack(worker: str, digest: str, *, ok: bool = True, code: ErrorCode | None = None) -> Ack:
    return Ack(
        update_id="u", phase=Phase.LOAD, worker_id=worker, ok=ok, world_size=1, adapters=[],
        paused=True, digest=digest,
        error=None if code is None else ErrorInfo(code=code, message="x"),
    )  # fmt: skip


def test_the_coordinators_rule() -> None:
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    agree = {"w0": _ack("w0", a), "w1": _ack("w1", a), "w2": _ack("w2", "")}
    differ = {"w0": _ack("w0", a), "w1": _ack("w1", b)}
    refused = {"w0": _ack("w0", a), "w1": _ack("w1", b, ok=False, code=ErrorCode.DIGEST_MISMATCH)}

    assert digest_problem(None, agree) is None, "an agent that cannot read the path is not counted"
    assert digest_problem(a, {"w0": agree["w0"], "w1": agree["w1"]}) is None
    unreadable = digest_problem(a, agree)
    disagree = digest_problem(None, differ)
    wrong = digest_problem(a, refused)
    assert unreadable is not None and "w2 sees unreadable" in unreadable.message
    assert disagree is not None and disagree.code == ErrorCode.DIGEST_MISMATCH
    assert f"w0 see {a}" in disagree.message and f"w1 see {b}" in disagree.message
    assert wrong is not None and f"w1 sees {b}" in wrong.message and a in wrong.message


@pytest.mark.parametrize(
    "claimed",
    ["sha256:" + "A" * 64, "sha256:" + "a" * 63, "md5:" + "a" * 32, "sha256:" + "a" * 64 + "\n"],
)
def test_an_ack_claiming_a_malformed_digest_does_not_decode(claimed: str) -> None:
    """A digest an agent reports may become the committed one that every
    reloading agent checks against: only the defined form, or "", gets in."""
    good = msgspec.json.encode(_ack("w0", "sha256:" + "a" * 64))
    bad = good.replace(b"sha256:" + b"a" * 64, msgspec.json.encode(claimed)[1:-1])

    assert ack_decoder.decode(good).digest == "sha256:" + "a" * 64
    assert ack_decoder.decode(msgspec.json.encode(_ack("w0", ""))).digest == ""
    with pytest.raises(BadPayload, match="digest"):
        ack_decoder.decode(bad)


@pytest.fixture
def can_mount() -> None:
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    )
    if os.geteuid() != 0 or probe.returncode != 0:
        pytest.skip(f"needs root and mount namespaces (unshare): {probe.stderr.decode()[:200]}")


async def test_a_member_on_a_stale_filesystem_keeps_the_update_from_committing(
    can_mount: None,
    nats_url: str,
    fleet_name: str,
    tmp_path: Path,
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    sim = await start_sim(WORKERS)
    current = write_adapter(tmp_path / "shared", 2)
    stale = write_adapter(tmp_path / "stale-copy", 1)
    await processes.start_coordinator(
        CoordinatorConfig(
            fleet=fleet_name, frontend_url=sim.url, expected_world_size=sum(WORKERS.values())
        ),
        nats_url=nats_url,
    )
    for worker_id, world_size in WORKERS.items():
        # w001's host shows the older copy at the current adapter's path.
        launcher = (
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$1" "$2" && shift 2 && exec "$@"',
                "sh", str(stale), str(current)]
            if worker_id == "w001"
            else []
        )  # fmt: skip
        await processes.start_agent(
            _agent(fleet_name, worker_id, world_size, sim),
            nats_url=nats_url,
            launcher=launcher,
        )
    async with await UpdateClient.connect(nats_url, fleet_name) as client:
        await wait_live_workers(client, WORKERS, processes=processes)
        asked = await client.update(
            "policy", str(current), version=2, digest=adapter_digest(current), timeout_s=60
        )
        among_themselves = await client.update("policy", str(current), version=3, timeout_s=60)
        shown = await run_lorabus(
            "update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy",
            "--path", str(current), "--version", "4", "--digest", "auto", "--json",
        )  # fmt: skip

    want, old = adapter_digest(current), adapter_digest(stale)
    assert want != old
    assert asked.error is not None and asked.error.code == ErrorCode.DIGEST_MISMATCH, asked
    assert f"w001 sees {old}" in asked.error.message and want in asked.error.message
    assert among_themselves.error is not None, among_themselves
    assert among_themselves.error.code == ErrorCode.DIGEST_MISMATCH
    assert f"w000 see {want}" in among_themselves.error.message
    assert f"w001 see {old}" in among_themselves.error.message
    assert shown.returncode == 1 and '"digest_mismatch"' in shown.stdout, shown
    # Nothing committed, every engine resumed, and no engine serves any of them.
    for worker in sim.workers.values():
        assert not worker.paused, worker.worker_id
        assert not [a for a in worker.adapters if a.startswith("policy")], worker.adapters


async def test_members_that_see_the_same_bytes_commit_with_the_digest(
    nats_url: str,
    fleet_name: str,
    tmp_path: Path,
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    sim = await start_sim(WORKERS)
    current = write_adapter(tmp_path / "shared", 1)
    await processes.start_coordinator(
        CoordinatorConfig(
            fleet=fleet_name, frontend_url=sim.url, expected_world_size=sum(WORKERS.values())
        ),
        nats_url=nats_url,
    )
    for worker_id, world_size in WORKERS.items():
        await processes.start_agent(
            _agent(fleet_name, worker_id, world_size, sim), nats_url=nats_url
        )
    async with await UpdateClient.connect(nats_url, fleet_name) as client:
        await wait_live_workers(client, WORKERS, processes=processes)
        asked = await client.update(
            "policy", str(current), version=1, digest=adapter_digest(current), timeout_s=60
        )
        agreed = await client.update("policy", str(current), version=2, timeout_s=60)

    assert asked.committed and agreed.committed, (asked.error, agreed.error)
    assert asked.digest == agreed.digest == adapter_digest(current)


def _agent(fleet: str, worker_id: str, world_size: int, sim: SimFleet) -> AgentConfig:
    return AgentConfig(
        fleet=fleet,
        worker_id=worker_id,
        system_url=sim.system_url(worker_id),
        frontend_url=sim.url,
        world_size=world_size,
        heartbeat_s=0.2,
    )


DEADLINE_S = 10.0


async def test_without_a_requested_digest_the_engine_loads_while_the_directory_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack's digest is read beside the load, not before it: the hash here
    finishes only once the engine holds the adapter."""
    adapter = write_adapter(tmp_path / "v1", 1)
    engine_has_it = threading.Event()

    def digest_once_loaded(directory: str) -> str:
        engine_has_it.wait(DEADLINE_S * 2)
        return adapter_digest(directory)

    monkeypatch.setattr(digest_module, "adapter_digest", digest_once_loaded)
    async with SimFleet(["w0"], [1]) as sim:
        driver = DynamoDriver(sim.system_url("w0"))
        executor = CommandExecutor("w0", 1, driver)
        worker = sim.workers["w0"]
        command = LoadCommand(
            update_id="u1", budget_s=DEADLINE_S * 3, served_name="p-v1", path=str(adapter)
        )
        try:
            loading = asyncio.create_task(executor.execute(command, DEADLINE_S * 3))
            await asyncio.wait_for(worker.wait_until(lambda: "p-v1" in worker.adapters), DEADLINE_S)
            engine_has_it.set()
            ack = await asyncio.wait_for(loading, DEADLINE_S)
        finally:
            engine_has_it.set()
            await driver.aclose()

    assert ack.ok, ack.error
    assert ack.digest == adapter_digest(adapter)


async def test_agents_of_one_process_share_a_read_under_way_and_only_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads asked for while one is under way share it, a caller cancelled
    leaves it to the others, and a read asked for afterwards reads the files
    again (and sees what changed)."""
    adapter = write_adapter(tmp_path / "v1", 1)
    before = adapter_digest(adapter)
    release = threading.Event()
    reads: list[str] = []

    def counted(directory: str) -> str:
        reads.append(directory)
        release.wait(DEADLINE_S)
        return adapter_digest(directory)

    monkeypatch.setattr(digest_module, "adapter_digest", counted)
    async with asyncio.timeout(DEADLINE_S * 2):
        waiting = [asyncio.create_task(read_adapter_digest(str(adapter))) for _ in range(8)]
        await asyncio.sleep(0.05)
        waiting[0].cancel()
        release.set()
        shared = await asyncio.gather(*waiting[1:])
        (adapter / "adapter_config.json").write_text("{}")
        again = await read_adapter_digest(str(adapter))

    assert waiting[0].cancelled()
    assert shared == [before] * 7
    assert reads == [str(adapter), str(adapter)]
    assert again != before and again == adapter_digest(adapter)
