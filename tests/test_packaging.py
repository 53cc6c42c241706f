"""What the wheel is built from, checked in a second: pyproject.toml's package
list against the source folders, and how an extra's missing distributions are found.

The editable install that the tests run on finds every part in its source
folder, so a subpackage left out of ``[tool.setuptools] packages`` would pass
every other test and still be missing from the wheel. ``scripts/check-wheel``
builds and installs the real wheel; these tests catch the usual cause early.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from lorabus.cli.extras import SIM_EXTRA, missing_distributions, missing_from_extra

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]

NOT_INSTALLED = "lorabus-test-distribution-that-is-never-installed"


def packages_in_tree() -> set[str]:
    """The import name of every folder with an ``__init__.py`` under the package-dir folders."""
    found = set()
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(base).parts)))
    return found


def test_every_folder_with_an_init_py_under_the_package_dir_folders_is_listed_in_packages() -> None:
    unlisted = sorted(packages_in_tree() - set(SETUPTOOLS["packages"]))
    assert not unlisted, (
        f"add {unlisted} to [tool.setuptools] packages in pyproject.toml, "
        "or the wheel will not have them"
    )


def test_every_listed_package_is_a_folder_with_an_init_py() -> None:
    assert sorted(set(SETUPTOOLS["packages"]) - packages_in_tree()) == []


def test_every_package_dir_mapping_points_at_an_existing_folder() -> None:
    missing = [folder for folder in PACKAGE_DIR.values() if not (ROOT / folder).is_dir()]
    assert missing == []


def test_every_package_dir_import_name_is_under_lorabus() -> None:
    assert [p for p in PACKAGE_DIR if p != "lorabus" and not p.startswith("lorabus.")] == []


def test_py_typed_is_shipped_as_package_data_and_exists() -> None:
    assert "py.typed" in SETUPTOOLS["package-data"]["lorabus"]
    assert (ROOT / PACKAGE_DIR["lorabus"] / "py.typed").is_file()


def test_nothing_of_the_sim_extra_is_missing_in_this_full_environment() -> None:
    assert missing_from_extra(SIM_EXTRA) == []


def test_the_installed_metadata_names_the_distributions_of_the_sim_extra() -> None:
    requirements = importlib.metadata.requires("lorabus") or []
    sim = [r for r in requirements if 'extra == "sim"' in r.replace("'", '"')]
    assert sim, "the installed metadata lists no distribution for the sim extra"


def test_the_distributions_of_an_extra_that_are_not_installed_are_named() -> None:
    requirements = [
        'click>=8.1; extra == "gpu"',
        f'{NOT_INSTALLED}>=1.0; extra == "gpu"',
        f"{NOT_INSTALLED}-too[fast]; python_version >= '3.8' and extra == 'gpu'",
    ]
    assert missing_distributions(requirements, "gpu") == [NOT_INSTALLED, f"{NOT_INSTALLED}-too"]


def test_only_the_asked_extra_counts_and_lorabus_itself_is_skipped() -> None:
    requirements = [
        "msgspec>=0.18",
        f"{NOT_INSTALLED}; extra == 'other'",
        f"{NOT_INSTALLED}-base>=1",
        'lorabus[sim]; extra == "gpu"',
        'numpy>=1.26; extra == "gpu"',
    ]
    assert missing_distributions(requirements, "gpu") == []
