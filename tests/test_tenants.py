"""The tenants file, its rules as plain functions, and what ``lorabus auth init
--tenant`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from lorabus.cli.main import main
from lorabus.coordinator.tenants import (
    Tenants,
    forbidden,
    forbidden_on_generic,
    over_quota,
    result_for,
    status_for,
)
from lorabus.schemas import (
    AdapterStatus,
    ErrorCode,
    FleetStatus,
    MemberStatus,
    RunningUpdate,
    Subjects,
    UpdateResult,
    encode,
)
from lorabus.schemas.tenants import TENANT_ENV, TENANTS_ENV, Tenant, parse_tenant
from lorabus.security.accounts import fleet_accounts
from lorabus.security.roles import Role, permissions


def test_a_tenant_is_name_equals_pattern() -> None:
    assert parse_tenant("team-a=team-a-*") == ("team-a", Tenant(adapters="team-a-*"))
    for bad in ("team-a", "a.b=x", "a=", "=x"):
        with pytest.raises(ValueError):
            parse_tenant(bad)


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"a": {"adapters": "a-*", "max_queued": 0}}',
        b'{"a": {"adapters": "a-*", "max_keep": 65}}',
        b'{"a": {"adapters": "a-*", "admin": true}}',
        b'{"a.b": {"adapters": "a-*"}}',
        b'{"a": {}}',
    ],
)
def test_a_tenants_file_that_is_not_one_is_refused_saying_where(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "tenants.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="tenants file"):
        Tenants.load(str(path))
    with pytest.raises(ValueError, match="tenants file"):
        Tenants.load(str(tmp_path / "missing.json"))
    assert not Tenants.load("")


@pytest.mark.parametrize("root", ["/", "//", "///", "relative/dir", ""])
def test_a_root_must_be_a_directory_below_the_filesystems_root(root: str) -> None:
    with pytest.raises(ValueError, match="root"):
        Tenant(adapters="a-*", roots=[root])


def test_the_rules_of_an_update() -> None:
    a = Tenant(adapters="a-*", max_adapters=2, max_keep=3, roots=["/adapters/a"])
    tenants = Tenants({"a": a, "b": Tenant(adapters="b-*"), "ab": Tenant(adapters="*-shared")})
    digest = "sha256:" + "0" * 64
    stored, in_b, shared = f"bus:a/{digest}", f"bus:b/{digest}", f"bus:{digest}"
    for path in (stored, "/adapters/a/1", "/adapters/a/x/../2"):
        assert forbidden("a", tenants, "a:1", "a-x", path) is None, path
    assert forbidden("b", tenants, "b:1", "b-x", in_b) is None
    cases = [
        ("c", "c:1", "c-x", stored),  # unknown tenant
        ("a", "b:1", "a-x", stored),  # another's id
        ("a", "a1", "a-x", stored),  # an id without the separator
        ("a", "a:1", "b-x", stored),  # another's adapter
        ("a", "a:1", "a-shared", stored),  # an adapter two tenants' patterns match
        # Paths on the workers outside its roots: another's, an escape, the root itself.
        ("a", "a:1", "a-x", "/adapters/b/1"),
        ("a", "a:1", "a-x", "/adapters/a/../b/1"),
        ("a", "a:1", "a-x", "/adapters/a"),
        ("a", "a:1", "a-x", "/adapters/ab/1"),
        ("a", "a:1", "a-x", "adapters/a/1"),
        ("b", "b:1", "b-x", "/adapters/b/1"),  # no roots: the store only
        # Objects of another's store, or of the fleet's: not its own.
        ("a", "a:1", "a-x", in_b),
        ("a", "a:1", "a-x", shared),
    ]
    for name, update_id, adapter, path in cases:
        refused = forbidden(name, tenants, update_id, adapter, path)
        assert refused is not None and refused.code == ErrorCode.FORBIDDEN, (name, update_id, path)
    # The orchestrator's own subject: any id but a tenant's.
    assert forbidden_on_generic(tenants, "step-2") is None
    assert forbidden_on_generic(tenants, "c:2") is None
    assert forbidden_on_generic(tenants, "step-2", shared) is None
    refused = forbidden_on_generic(tenants, "step-2", in_b)  # b's object, b's
    assert refused is not None and refused.code == ErrorCode.FORBIDDEN
    refused = forbidden_on_generic(tenants, "b:2")
    assert refused is not None and refused.code == ErrorCode.FORBIDDEN
    # Quotas, for a new id.
    assert over_quota("a", a, "a-x", 2, {"b-y"}) is None
    for adapter, keep, held in (("a-x", 4, set()), ("a-z", 2, {"a-x", "a-y"})):
        refused = over_quota("a", a, adapter, keep, held)
        assert refused is not None and refused.code == ErrorCode.QUOTA, (adapter, keep)
    # An adapter it holds already is no new one.
    assert over_quota("a", a, "a-x", 2, {"a-x", "a-y"}) is None


def test_a_result_is_shown_only_to_the_tenant_of_its_id() -> None:
    for served in ("policy-v3", "policy-r2-v3", "policy", ""):
        mine = UpdateResult(update_id="a:1", status="committed", adapter=served, version=3)
        assert result_for("a", mine) is mine
    for update_id in ("b:1", "1", "ab:1"):
        other = UpdateResult(update_id=update_id, status="committed", adapter="p-v3", version=3)
        hidden = result_for("a", other)
        assert hidden.status == "unknown" and hidden.adapter == "", hidden


def test_a_tenants_status_holds_only_its_own() -> None:
    member = MemberStatus(
        worker_id="w0",
        world_size=1,
        engine="vllm",
        paused=False,
        adapters=["a-x-v1", "b-y-v4", "a-x-v0"],
        heartbeat_age_s=0.1,
        rank_offset=0,
        ready=False,
        unready_reason="missing b-y-v5",
        missing=["b-y-v5"],
    )
    status = FleetStatus(
        fleet="f",
        expected_world_size=1,
        live_world_size=1,
        members=[member],
        committed_adapter="b-y",
        committed_version=4,
        in_flight="b:9",
        running=[RunningUpdate(update_id="b:9", adapter="b-y")],
        acked=["w0"],
        adapters=[
            AdapterStatus(
                adapter="a-x", served_name="a-x-v1", version=1, path="/a", kept=["a-x-v0"]
            ),
            AdapterStatus(adapter="b-y", served_name="b-y-v4", version=4, path="/b"),
        ],
    )
    seen = status_for(Tenant(adapters="a-*"), status)
    assert [a.adapter for a in seen.adapters] == ["a-x"]
    assert seen.members[0].adapters == ["a-x-v1", "a-x-v0"]
    assert seen.members[0].missing == [] and seen.members[0].unready_reason == ""
    assert seen.members[0].rank_offset is None and not seen.members[0].ready
    assert seen.committed_adapter is None and seen.in_flight is None
    assert seen.running == [] and seen.acked == []
    assert b"b-y" not in encode(seen) and b"b:9" not in encode(seen)


def test_a_tenants_account_imports_its_own_requests_only() -> None:
    subjects = Subjects(fleet="f")
    layout = fleet_accounts(subjects, ["w0"], ["a", "b"])
    a = layout.accounts[layout.of_role[(Role.TENANT, "a")]]
    imported = {i.subject for i in a.imports}
    assert {subjects.tenant_request("a", k) for k in ("update", "result", "status")} <= imported
    assert not any(".tenant.b." in s or s.endswith(".req.update") for s in imported)
    allowed = permissions(Role.TENANT, subjects, inbox_prefix="_I_a", worker_id="a")
    assert allowed.subscribe == ("_I_a.>",)
    assert subjects.tenant_request("b", "update") not in allowed.publish


def test_auth_init_writes_an_identity_per_tenant_and_the_coordinators_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "auth"
    ran = CliRunner().invoke(
        main,
        [
            "auth",
            "init",
            "--fleet",
            "f",
            "--workers",
            "w0",
            "--out",
            str(out),
            "--no-tls",
            "--tenant",
            "team-a=team-a-*",
            "--tenant",
            "team-b=team-b-*",
        ],
    )
    assert ran.exit_code == 0, ran.output
    assert "tenant-team-a" in ran.output
    assert f"{TENANT_ENV}=team-a" in (out / "tenant-team-a" / "lorabus.env").read_text()
    env = (out / "coordinator" / "lorabus.env").read_text()
    assert f"{TENANTS_ENV}={out.resolve() / 'coordinator' / 'tenants.json'}" in env
    tenants = Tenants.load(str(out / "coordinator" / "tenants.json"))
    assert set(tenants.by_name) == {"team-a", "team-b"}
    assert tenants.by_name["team-a"].owns("team-a-policy")
    conf = (out / "nats-server.conf").read_text()
    assert "LORABUS_F_TENANT_team-a" in conf
    twice = CliRunner().invoke(
        main,
        [
            "auth",
            "init",
            "--workers",
            "w0",
            "--out",
            str(tmp_path / "x"),
            "--tenant",
            "a=x",
            "--tenant",
            "a=y",
        ],
    )
    assert twice.exit_code != 0 and "different tenant" in twice.output


def test_the_fleets_jetstream_budget_holds_every_tenants_store() -> None:
    from lorabus.security.auth_init import JETSTREAM_BYTES_PER_REPLICA, default_jetstream_bytes

    tenants = {"a": Tenant(adapters="a-*"), "b": Tenant(adapters="b-*", max_bytes=3 << 30)}
    assert default_jetstream_bytes() == JETSTREAM_BYTES_PER_REPLICA
    assert default_jetstream_bytes(tenants=tenants) == JETSTREAM_BYTES_PER_REPLICA + (4 << 30)
    three = default_jetstream_bytes(["n1", "n2", "n3"], tenants)
    assert three == 3 * (JETSTREAM_BYTES_PER_REPLICA + (4 << 30))
