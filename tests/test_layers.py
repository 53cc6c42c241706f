"""The layers hold: the parts meet only on the bus, the wire contract imports
no other part, and the product never imports its development tooling.

Read from the source with ``ast`` (imports inside functions count too), as
import-linter would check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Folder -> the lorabus packages its modules must never import.
FORBIDDEN = {
    "schemas": ("lorabus",),  # only itself (checked below) and msgspec
    "agents": ("lorabus.coordinator", "lorabus.cli", "lorabus.testbed", "lorabus.simfleet"),
    "coordinator": ("lorabus.agents", "lorabus.cli", "lorabus.testbed", "lorabus.simfleet"),
    "simfleet": ("lorabus.agents", "lorabus.coordinator", "lorabus.cli", "lorabus.testbed"),
    "lorabus": ("lorabus.testbed", "lorabus.simfleet"),  # the product, less its dev tools
    # The CLI starts the testbed, never the other way round.
    "lorabus/testbed": ("lorabus.cli",),
}
#: The CLI modules of the development tools start them (lazily, inside the commands).
DEV_COMMANDS = {"lorabus/cli/demo.py", "lorabus/cli/measure.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from lorabus import testbed`` imports lorabus.testbed.
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(folder: str) -> list[Path]:
    paths = sorted((ROOT / folder).rglob("*.py"))
    if folder == "lorabus":
        paths = [p for p in paths if "testbed" not in p.relative_to(ROOT).parts]
    return paths


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_across_its_layer(folder: str) -> None:
    crossings = []
    for path in _modules(folder):
        relative = str(path.relative_to(ROOT))
        if relative in DEV_COMMANDS:
            continue
        for name in _imports(path):
            allowed_self = folder == "schemas" and name.startswith("lorabus.schemas")
            if allowed_self:
                continue
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[folder]):
                crossings.append(f"{relative} imports {name}")
    assert crossings == []


#: The layers of the lorabus package, lowest first: each folder imports of
#: lorabus only itself and what is named here (docs/architecture.md).
LAYERS = {
    "lorabus/runtime": (),
    "lorabus/bus": ("lorabus.runtime", "lorabus.errors", "lorabus.schemas"),
    "lorabus/adapters": ("lorabus.runtime", "lorabus.bus", "lorabus.errors", "lorabus.schemas"),
    "lorabus/security": ("lorabus.runtime", "lorabus.bus", "lorabus.errors", "lorabus.schemas"),
    "lorabus/audit": ("lorabus.runtime", "lorabus.bus", "lorabus.errors", "lorabus.schemas"),
}


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_each_layer_of_the_package_imports_only_those_below_it(folder: str) -> None:
    own = folder.replace("/", ".")
    allowed = (own, *LAYERS[folder])
    crossings = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _imports(path)
        if name.startswith("lorabus.")
        and not any(name == ok or name.startswith(ok + ".") for ok in allowed)
    ]
    assert crossings == []


def test_no_more_than_a_dozen_modules_stay_at_the_top() -> None:
    top = sorted(p.name for p in (ROOT / "lorabus").glob("*.py"))
    assert len(top) <= 12, top
