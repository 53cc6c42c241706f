"""The docs match the code: every file they name exists, every wire message and
field is in docs/protocol.md, every command is in the README's CLI table, and
every flag of the serving processes is there with the default the code has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import msgspec
import pytest

from lorabus.agents import AgentConfig
from lorabus.service_flags import AGENT_FLAGS, COORDINATOR_FLAGS
from lorabus.cli.main import main
from lorabus.coordinator import CoordinatorConfig
from lorabus.roles import Role, permissions
from lorabus.schemas import Subjects, messages, rankmap
from lorabus.schemas import errors as wire_errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FILE_NAME = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|md|json|toml|yaml|txt))`")


def _tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    )
    return listed.stdout.splitlines()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    tracked = _tracked_files()
    names = {Path(path).name for path in tracked}
    missing = []
    for cited in sorted(set(_FILE_NAME.findall(doc.read_text()))):
        exists = cited in tracked if "/" in cited else cited in names
        if not exists:
            missing.append(cited)
    assert missing == [], f"{doc.name} names files that do not exist: {missing}"


def _wire_structs() -> list[type[msgspec.Struct]]:
    found = []
    for module in (messages, rankmap, wire_errors):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, msgspec.Struct)
                and value.__module__ == module.__name__
                and not value.__name__.startswith("_")
            ):
                found.append(value)
    return found


@pytest.mark.parametrize("struct", _wire_structs(), ids=lambda s: s.__name__)
def test_every_wire_message_and_field_is_in_the_protocol_doc(
    struct: type[msgspec.Struct],
) -> None:
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    tag = struct.__struct_config__.tag
    if isinstance(tag, str):
        assert f"`{tag}`" in protocol, f"message {tag!r} is not in docs/protocol.md"
    undocumented = [f for f in struct.__struct_fields__ if f"`{f}`" not in protocol]
    assert undocumented == [], f"{struct.__name__} fields missing from the doc: {undocumented}"


def _commands(group: click.Group, prefix: str = "lorabus") -> list[str]:
    names = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            names += _commands(command, f"{prefix} {name}")
        else:
            names.append(f"{prefix} {name}")
    return names


def test_every_command_is_in_the_readme_cli_table() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in _commands(main) if f"| `{name}" not in readme]
    assert missing == [], f"commands missing from the README's CLI table: {missing}"


@pytest.mark.parametrize(
    ("command", "flags"), [("agent", AGENT_FLAGS), ("coordinator", COORDINATOR_FLAGS)]
)
def test_every_flag_of_a_serving_process_is_in_its_readme_row(command: str, flags: tuple) -> None:
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `lorabus {command} "))
    missing = [flag.name for flag in flags if not re.search(rf"{flag.name}(?![\w-])", row)]
    assert missing == [], f"lorabus {command} flags missing from its README row: {missing}"
    config_type = AgentConfig if command == "agent" else CoordinatorConfig
    defaults = {f.name: f.default for f in msgspec.structs.fields(config_type)}
    wrong = []
    for flag in flags:
        default = defaults[flag.field]
        if isinstance(default, bool) or not isinstance(default, int | float):
            continue  # text, choices and "all" are shown by name
        if flag.type is not None and flag.type.__class__.__name__ == "QuorumType":
            continue
        shown = {f"{flag.name} {default}", f"{flag.name} {default:g}"}
        if not any(f"[{text}]" in row for text in shown):
            wrong.append(f"{flag.name} (default {default})")
    assert wrong == [], f"lorabus {command} defaults not shown as in the code: {wrong}"


@pytest.mark.parametrize("role", list(Role))
def test_the_security_doc_lists_every_permission_of_every_role(role: Role) -> None:
    security = (ROOT / "docs" / "security.md").read_text()
    granted = permissions(
        role,
        Subjects(fleet="prod"),
        inbox_prefix="<inbox>",
        worker_id="w000" if role is Role.AGENT else None,
    )
    missing = [s for s in (*granted.publish, *granted.subscribe) if f"`{s}`" not in security]
    assert missing == [], f"{role} permissions missing from docs/security.md: {missing}"


def test_the_readme_draws_the_exception_tree_of_lorabus_errors() -> None:
    from lorabus import errors

    doc = errors.__doc__ or ""
    tree = doc[doc.index("    LorabusError") : doc.index("\n\n", doc.index("    LorabusError"))]
    readme = (ROOT / "README.md").read_text()
    missing = [line.strip() for line in tree.splitlines() if line.strip() not in readme]
    assert missing == [], f"README's exception tree lacks: {missing}"
