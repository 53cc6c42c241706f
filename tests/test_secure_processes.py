"""A secured fleet as an operator sets it up by hand: ``lorabus auth init``, a
nats-server from its configuration, ``lorabus provision`` as the operator,
and every ``lorabus`` process as its own identity (``--identity``). An
update commits, a tenant updates its own adapter and is refused another's,
the auditor finds the trail clean, and no secret shows anywhere: not in a
process's arguments, its output, its logs or the trail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from processes import Finished, Processes, run_lorabus

from lorabus.bus.options import ENV_FILE, identity_env
from lorabus.coordinator import CoordinatorConfig
from lorabus.security.auth_init import SEED_FILE
from lorabus.simfleet import SimFleet
from lorabus.testbed.natsserver import NatsServer

WORLD_SIZES = {"w000": 2, "w001": 1}
TOKEN = "a-token-that-must-not-show"


@pytest.fixture
async def auth_dir(tmp_path: Path, fleet_name: str) -> Path:
    out = tmp_path / "auth"
    finished = await run_lorabus(
        "auth", "init", "--fleet", fleet_name, "--workers", ",".join(WORLD_SIZES),
        "--out", str(out), "--tenant", "team-a=team-a-*",
    )  # fmt: skip
    assert finished.returncode == 0, finished
    return out


@pytest.fixture
async def server(auth_dir: Path) -> AsyncIterator[NatsServer]:
    async with NatsServer(include=auth_dir / "nats-server.conf") as started:
        yield started


def _secrets(auth_dir: Path) -> list[str]:
    seeds = [p.read_text().strip() for p in auth_dir.rglob(SEED_FILE)]
    keys = [p.read_text() for p in auth_dir.rglob("*-key.pem")]
    return [*seeds, *(k.splitlines()[1] for k in keys), TOKEN]


def _as(identity: Path) -> dict[str, str | None]:
    return {"LORABUS_IDENTITY": str(identity)}


async def test_every_process_on_its_own_identity_commits_and_no_secret_shows(
    auth_dir: Path,
    server: NatsServer,
    processes: Processes,
    fleet_name: str,
    start_sim: Callable[..., Awaitable[SimFleet]],
    make_adapter: Callable[[int], str],
) -> None:
    url = f"tls://127.0.0.1:{server.port}"
    operator = await run_lorabus(
        "provision", "--nats", url, "--fleet", fleet_name, env=_as(auth_dir / "operator")
    )
    assert operator.returncode == 0, operator
    # Once set up, the fleet's streams are the operator's to create, not to change.
    again = await run_lorabus(
        "provision",
        "--nats",
        url,
        "--fleet",
        fleet_name,
        "--audit-max-bytes",
        "1048576",
        env=_as(auth_dir / "operator"),
    )
    assert again.returncode == 1, again
    assert "may not change a stream's configuration" in again.stderr, again
    sim = await start_sim(WORLD_SIZES)
    coordinator = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=20,
    )
    await processes.start_coordinator(coordinator, nats_url=url, env=_as(auth_dir / "coordinator"))
    await processes.start_agents(
        WORLD_SIZES,
        sim.system_url,
        frontend_url=sim.url,
        fleet=fleet_name,
        nats_url=url,
        env_of=lambda worker_id: _as(auth_dir / f"agent-{worker_id}"),
    )

    async def update(
        adapter: str, step: int, version: int, identity: str, *, where: str = "--path"
    ) -> Finished:
        return await run_lorabus(
            "update", "--nats", url, "--fleet", fleet_name, "--adapter", adapter,
            where, make_adapter(step), "--version", str(version), "--timeout", "60",
            "--json", env=_as(auth_dir / identity),
        )  # fmt: skip

    orchestrator = _as(auth_dir / "orchestrator")
    update_ = await update("policy", 1, 1, "orchestrator")
    assert update_.returncode == 0, update_
    assert '"status": "committed"' in update_.stdout

    # A tenant, as its identity (its lorabus.env names it; the coordinator's
    # names the tenants file): its own adapter, pushed to the store, commits;
    # from a path on the workers, or another's adapter, it is refused.
    tenant = _as(auth_dir / "tenant-team-a")
    own = await update("team-a-policy", 2, 1, "tenant-team-a", where="--source")
    assert own.returncode == 0 and '"update_id": "team-a:' in own.stdout, own
    on_disk = await update("team-a-policy", 4, 2, "tenant-team-a")
    assert on_disk.returncode == 1 and '"code": "forbidden"' in on_disk.stdout, on_disk
    theirs = await update("policy", 3, 2, "tenant-team-a")
    assert theirs.returncode == 1 and '"code": "forbidden"' in theirs.stdout, theirs
    seen = await run_lorabus("status", "--nats", url, "--fleet", fleet_name, "--json", env=tenant)
    assert seen.returncode == 0, seen
    assert "team-a-policy" in seen.stdout and '"policy"' not in seen.stdout, seen.stdout

    verified = await run_lorabus(
        "audit", "verify", "--live", "--nats", url, "--fleet", fleet_name,
        env=_as(auth_dir / "auditor"),
    )  # fmt: skip
    assert verified.returncode == 0, verified
    assert verified.stdout.strip().endswith("0 violation(s)"), verified

    # A token in the environment beside an nkey is refused, and not printed.
    refused = await run_lorabus(
        "status", "--nats", url, "--fleet", fleet_name,
        env={**orchestrator, "LORABUS_NATS_TOKEN": TOKEN},
    )  # fmt: skip
    assert refused.returncode == 1 and "one way to authenticate" in refused.stderr, refused

    processes.check_alive()
    trail = await run_lorabus(
        "tap", "--no-follow", "--nats", url, "--fleet", fleet_name, env=_as(auth_dir / "auditor")
    )
    assert trail.returncode == 0, trail
    shown = [update_.stdout, update_.stderr, verified.stdout, verified.stderr, refused.stderr]
    shown += [own.stdout, own.stderr, theirs.stdout, seen.stdout]
    shown += [trail.stdout, *_what_processes_show(processes)]
    leaks = [s[:12] for s in _secrets(auth_dir) if any(s in text for text in shown)]
    assert leaks == [], f"secrets (first characters) shown: {leaks}"


def _what_processes_show(processes: Processes) -> list[str]:
    """Each child's arguments (as the kernel shows them to every user) and its log."""
    shown = []
    for child in processes.children:
        shown.append(Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace"))
        shown.append(child.log_path.read_text(errors="replace"))
    return shown


async def test_identity_folders_keep_their_secrets_to_their_owner(auth_dir: Path) -> None:
    _check_modes(auth_dir)


def _check_modes(auth_dir: Path) -> None:
    assert auth_dir.stat().st_mode & 0o777 == 0o700
    for identity in [p for p in auth_dir.iterdir() if (p / ENV_FILE).exists()]:
        assert identity.stat().st_mode & 0o777 == 0o700, identity
        for secret in (identity / SEED_FILE, identity / "client-key.pem"):
            assert secret.stat().st_mode & 0o777 == 0o600, secret
        env = identity_env(identity)
        assert not any(value.startswith("SU") for value in env.values()), "a seed in the env file"
    assert (auth_dir / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    assert (auth_dir / "nats-server.conf").stat().st_mode & 0o777 == 0o600
