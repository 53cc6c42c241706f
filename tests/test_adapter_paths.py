"""An agent resolves a load's path on its own host and checks it against its roots;
served names that could leave their URL segment are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorabus.agents.adapter_paths import check_served_name, resolve_adapter_dir
from lorabus.testbed.trainer import write_adapter


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real adapter outside the root."""
    return write_adapter(tmp_path / "elsewhere", 1)


def test_an_adapter_under_the_root_is_handed_on_as_its_real_path(root: Path) -> None:
    adapter = write_adapter(root, 1)
    (root / "sub").mkdir()

    assert resolve_adapter_dir(str(adapter), [str(root)]) == str(adapter)
    assert resolve_adapter_dir(f"{root}/./sub/../step_1", [str(root)]) == str(adapter)


def test_a_symlink_in_the_root_to_a_directory_outside_is_refused(root: Path, outside: Path) -> None:
    (root / "step_9").symlink_to(outside)

    with pytest.raises(ValueError, match="outside the adapter roots") as refused:
        resolve_adapter_dir(str(root / "step_9"), [str(root)])
    assert str(outside) in str(refused.value), "the message shows where it leads"


def test_a_dotdot_path_escaping_the_root_is_refused(root: Path, outside: Path) -> None:
    escaping = f"{root}/../elsewhere/step_1"

    with pytest.raises(ValueError, match="outside the adapter roots"):
        resolve_adapter_dir(escaping, [str(root)])


def test_a_sibling_with_the_roots_name_as_prefix_is_outside(tmp_path: Path, root: Path) -> None:
    sibling = write_adapter(tmp_path / "root-other", 1)

    with pytest.raises(ValueError, match="outside the adapter roots"):
        resolve_adapter_dir(str(sibling), [str(root)])


def test_a_directory_without_an_adapter_config_is_refused(root: Path) -> None:
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("no adapter here\n")
    (root / "file").write_text("x")

    with pytest.raises(ValueError, match=r"holds no adapter_config\.json"):
        resolve_adapter_dir(str(root / "notes"), [str(root)])
    with pytest.raises(ValueError, match="not a directory"):
        resolve_adapter_dir(str(root / "file"), [str(root)])


def test_a_path_missing_on_this_host_or_relative_is_refused(root: Path) -> None:
    with pytest.raises(ValueError, match="cannot be resolved on this host"):
        resolve_adapter_dir(str(root / "step_404"), [str(root)])
    with pytest.raises(ValueError, match="not an absolute path"):
        resolve_adapter_dir("step_1", [str(root)])
    with pytest.raises(ValueError, match="not an absolute path"):
        resolve_adapter_dir(f"{root}/step_1\0", [str(root)])


def test_a_root_that_is_a_symlink_still_covers_its_adapters(tmp_path: Path, root: Path) -> None:
    adapter = write_adapter(root, 1)
    linked_root = tmp_path / "current"
    linked_root.symlink_to(root)

    real = resolve_adapter_dir(str(linked_root / "step_1"), [str(linked_root)])

    assert real == os.path.realpath(adapter)


def test_any_of_several_roots_will_do(tmp_path: Path, root: Path, outside: Path) -> None:
    roots = [str(root), str(tmp_path / "elsewhere")]

    assert resolve_adapter_dir(str(outside), roots) == str(outside)


def test_without_roots_the_path_goes_on_unread(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-here" / "step_1")

    assert resolve_adapter_dir(missing, []) == missing
    with pytest.raises(ValueError, match="not an absolute path"):
        resolve_adapter_dir("relative/step_1", [])


@pytest.mark.parametrize(
    "name", ["policy-v1", "org/policy-v7", "a", "p.q_r-s/t-v9223372036854775807", "x" * 150]
)
def test_served_names_the_coordinator_makes_pass(name: str) -> None:
    assert check_served_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../engine/pause_generation",
        "a/../../engine/pause_generation",
        "a//b",
        "/abs",
        "p-v1/",
        "p?mode=abort",
        "p#frag",
        "p%2F..",
        "a b",
        "ü",
        "x" * 151,
    ],
)
def test_served_names_that_could_leave_their_segment_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="served name"):
        check_served_name(name)
