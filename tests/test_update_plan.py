"""Requests are validated and named before any engine is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.plan import (
    check_request,
    check_request_off_loop,
    own_names,
    retired_names,
)
from lorabus.errors import BadRequest, StaleVersion
from lorabus.schemas import CommittedRecord, Naming, UpdateRequest, build_rank_map
from lorabus.testbed.trainer import write_adapter

CONFIG = CoordinatorConfig(fleet="f", frontend_url="http://127.0.0.1:1", expected_world_size=1)


def _committed(version: int, path: str = "/ckpt/step_5") -> CommittedRecord:
    return CommittedRecord(
        adapter="policy",
        version=version,
        path=path,
        served_name=f"policy-v{version}",
        rank_map=build_rank_map({"w": 1}),
    )


def _request(**kw: object) -> UpdateRequest:
    fields = {"update_id": "u", "adapter": "policy", "path": "/ckpt/step_1"} | kw
    return UpdateRequest(**fields)  # type: ignore[arg-type]


def test_versioned_naming_serves_a_new_name_per_version() -> None:
    plan = check_request(_request(version=7), CONFIG).plan(None)

    assert (plan.served_name, plan.replace, plan.version) == ("policy-v7", False, 7)


def test_fixed_naming_replaces_the_name_in_place() -> None:
    config = CoordinatorConfig(
        fleet="f", frontend_url="http://x", expected_world_size=1, naming=Naming.FIXED
    )
    plan = check_request(_request(version=7), config).plan(None)

    assert (plan.served_name, plan.replace) == ("policy", True)


def test_a_missing_version_is_one_past_the_committed_one() -> None:
    assert check_request(_request(), CONFIG).plan(None).version == 1
    assert check_request(_request(), CONFIG).plan(_committed(5)).version == 6


@pytest.mark.parametrize("name", ["", "-x", "a b", "a..b", "x/", "a//b", "ü"])
def test_bad_adapter_names_are_refused(name: str) -> None:
    with pytest.raises(BadRequest, match="adapter name"):
        check_request(_request(adapter=name), CONFIG).plan(None)


def test_paths_must_be_absolute_and_under_the_roots() -> None:
    with pytest.raises(BadRequest, match="absolute"):
        check_request(_request(path="ckpt/step_1"), CONFIG).plan(None)
    rooted = CoordinatorConfig(
        fleet="f", frontend_url="http://x", expected_world_size=1, adapter_roots=["/ckpt"]
    )
    assert check_request(_request(path="/ckpt/step_1"), rooted).plan(None).path == "/ckpt/step_1"
    with pytest.raises(BadRequest, match="outside the adapter roots"):
        check_request(_request(path="/ckpt/../etc"), rooted).plan(None)
    with pytest.raises(BadRequest, match="outside the adapter roots"):
        check_request(_request(path="/ckpt-other/step_1"), rooted).plan(None)


def _rooted(*roots: Path | str) -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet="f",
        frontend_url="http://x",
        expected_world_size=1,
        adapter_roots=[str(root) for root in roots],
    )


def test_a_visible_symlink_out_of_the_root_is_refused_by_where_it_leads(tmp_path: Path) -> None:
    outside = write_adapter(tmp_path / "elsewhere", 1)
    root = tmp_path / "root"
    root.mkdir()
    (root / "step_1").symlink_to(outside)

    with pytest.raises(BadRequest, match="outside the adapter roots") as refused:
        check_request(_request(path=str(root / "step_1")), _rooted(root)).plan(None)
    assert f"resolved: {outside}" in str(refused.value)


def test_a_root_that_is_a_symlink_covers_what_it_holds_and_the_path_is_kept(
    tmp_path: Path,
) -> None:
    write_adapter(tmp_path / "real", 1)
    (tmp_path / "current").symlink_to(tmp_path / "real")
    path = str(tmp_path / "current" / "step_1")

    assert check_request(_request(path=path), _rooted(tmp_path / "current")).plan(None).path == path


def test_a_path_this_host_cannot_see_is_checked_as_text(tmp_path: Path) -> None:
    # The agents check it again where the engine reads it.
    root = tmp_path / "root"
    unseen = str(root / "step_404")

    assert check_request(_request(path=unseen), _rooted(root)).plan(None).path == unseen
    with pytest.raises(BadRequest, match="outside the adapter roots"):
        check_request(_request(path=f"{root}/../elsewhere/step_1"), _rooted(root)).plan(None)
    with pytest.raises(BadRequest, match="absolute"):
        check_request(_request(path=f"{root}/step_1\0"), _rooted(root)).plan(None)


def test_an_older_version_is_stale_and_the_same_version_needs_the_same_path() -> None:
    with pytest.raises(StaleVersion, match="older than the committed version 5"):
        check_request(_request(version=4), CONFIG).plan(_committed(5))
    with pytest.raises(BadRequest, match="already committed"):
        check_request(_request(version=5, path="/ckpt/other"), CONFIG).plan(_committed(5))


def test_retired_names_are_the_adapters_versions_neither_committed_nor_kept() -> None:
    loaded = {"policy-v1", "policy-v2", "policy-v10", "other-v1", "policy", "policy-vx"}

    assert retired_names("policy", loaded, {"policy-v10", "policy-v2"}) == ["policy-v1"]
    assert retired_names("policy", loaded, {"policy-v10"}) == ["policy-v1", "policy-v2"]
    # A version the engines hold that no commit keeps (a failed update's, say)
    # goes too, however new: what is served is what the commit keeps.
    assert retired_names("policy", loaded, {"policy-v2", "policy-v1"}) == ["policy-v10"]
    # Another adapter's names never: not even those it keeps.
    assert retired_names("other", loaded, {"other-v2"}) == ["other-v1"]


def test_an_adapters_own_names_are_its_versions_of_any_lineage_and_its_fixed_name() -> None:
    held = ["policy-v1", "policy-r2-v3", "policy", "other-v1", "policy-vx", "policy2-v1", "x"]

    assert own_names("policy", held) == ["policy-v1", "policy-r2-v3", "policy"]
    assert own_names("other", held) == ["other-v1"]


def test_after_a_reset_names_carry_the_lineage_and_earlier_ones_retire_unless_kept() -> None:
    loaded = {"policy-v9000", "policy-v9001", "policy-r1-v2", "policy-r2-v1", "policy-r2-v2"}

    assert check_request(_request(version=3), CONFIG).plan(None, lineage=2).served_name == (
        "policy-r2-v3"
    )
    assert check_request(_request(version=3), CONFIG).plan(None).served_name == "policy-v3"
    assert retired_names("policy", loaded, {"policy-r2-v2", "policy-r2-v1"}) == [
        "policy-v9000",
        "policy-v9001",
        "policy-r1-v2",
    ]


def test_keep_comes_from_the_request_else_the_coordinator() -> None:
    assert check_request(_request(), CONFIG).plan(None).keep == CONFIG.keep
    assert check_request(_request(keep=3), CONFIG).plan(None).keep == 3
    assert check_request(_request(keep=1), CONFIG).plan(None).keep == 1
    with pytest.raises(BadRequest, match="keep must be 1 to 64"):
        check_request(_request(keep=0), CONFIG)
    with pytest.raises(BadRequest, match="keep must be 1 to 64"):
        check_request(_request(keep=65), CONFIG)


def test_a_request_to_keep_versions_needs_versioned_naming() -> None:
    config = CoordinatorConfig(
        fleet="f", frontend_url="http://x", expected_world_size=1, naming=Naming.FIXED
    )
    with pytest.raises(BadRequest, match="keep 3 needs versioned naming"):
        check_request(_request(keep=3), config)
    assert check_request(_request(keep=1), config).plan(None).keep == 1


def test_an_adapter_name_that_ends_like_a_lineage_is_refused() -> None:
    with pytest.raises(BadRequest, match="lineage"):
        check_request(_request(adapter="policy-r1"), CONFIG).plan(None)
    assert check_request(_request(adapter="policy-rl"), CONFIG).plan(None).adapter == "policy-rl"


async def test_a_path_the_coordinator_cannot_resolve_in_time_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung mount must not stall the event loop: the look runs in a thread
    under a deadline (here a filesystem call that never returns in time)."""
    import threading

    from lorabus.coordinator import plan

    release = threading.Event()
    monkeypatch.setattr(plan, "RESOLVE_DEADLINE_S", 0.2)
    monkeypatch.setattr(plan, "_visible_realpath", lambda path: release.wait(5) and None)
    rooted = CoordinatorConfig(
        fleet="f",
        frontend_url="http://127.0.0.1:1",
        expected_world_size=1,
        adapter_roots=[str(tmp_path)],
    )
    try:
        with pytest.raises(BadRequest, match="could not resolve"):
            await check_request_off_loop(_request(path=str(tmp_path / "a")), rooted)
    finally:
        release.set()


def test_bad_settings_are_refused_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="keep"):
        CoordinatorConfig(fleet="f", frontend_url="http://x", expected_world_size=1, keep=0)
    with pytest.raises(ValueError, match="phase timeout"):
        CoordinatorConfig(
            fleet="f", frontend_url="http://x", expected_world_size=1, phase_timeout_s=0
        )
    with pytest.raises(ValueError, match="http"):
        CoordinatorConfig(fleet="f", frontend_url="ftp://x", expected_world_size=1)


DIGEST = "sha256:" + "ab" * 32


def test_an_adapter_from_the_object_store_is_planned_with_its_digest_whatever_the_roots() -> None:
    """A ``bus:`` path is no host path: the roots do not apply, and every
    member must see the digest it names."""
    config = CoordinatorConfig(
        fleet="f", frontend_url="http://x", expected_world_size=1, adapter_roots=["/ckpt"]
    )
    plan = check_request(_request(path=f"bus:{DIGEST}", version=3), config).plan(None)

    assert (plan.path, plan.digest) == (f"bus:{DIGEST}", DIGEST)


@pytest.mark.parametrize(
    ("path", "digest", "said"),
    [
        ("bus:sha256:XYZ", None, "not a valid"),
        ("bus:", None, "not a valid"),
        (f"bus:{DIGEST}", "sha256:" + "cd" * 32, "is not the one its path names"),
    ],
)
def test_an_object_store_path_with_a_bad_or_other_digest_is_refused(
    path: str, digest: str | None, said: str
) -> None:
    with pytest.raises(BadRequest, match=said):
        check_request(_request(path=path, digest=digest), CONFIG)
