"""The docs match the code: every file they name exists, every link between them
lands on a file and a heading, every wire message and field is in
docs/protocol.md, every command is in the README's CLI summary and in
docs/operations.md with every flag (the serving processes' with the default
the code has), and the README stays a short read without figures that go
stale (test counts, CI minutes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import msgspec
import pytest

from lorabus.agents import AgentConfig
from lorabus.cli.main import main
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import Subjects, commands, events, rankmap, records, reports, requests
from lorabus.schemas import errors as wire_errors
from lorabus.security.roles import Role, permissions
from lorabus.service_flags import AGENT_FLAGS, COORDINATOR_FLAGS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 350
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
    for module in (commands, reports, requests, events, records, rankmap, wire_errors):
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


@pytest.mark.parametrize("doc", [README, OPERATIONS], ids=lambda p: p.name)
def test_every_command_is_in_the_cli_tables(doc: Path) -> None:
    text = doc.read_text()
    missing = [name for name in _commands(main) if f"| `{name}" not in text]
    assert missing == [], f"commands missing from the CLI table of {doc.name}: {missing}"


def _command(name: str) -> click.Command:
    command: click.Command = main
    for word in name.split()[1:]:
        assert isinstance(command, click.Group)
        command = command.commands[word]
    return command


def _long_options(command: click.Command) -> set[str]:
    return {
        opt
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
        if opt.startswith("--")
    }


def _connection_options() -> set[str]:
    """The options every command that talks to the bus shares (--nats, --fleet,
    the identity): docs/operations.md lists them once, not in every row."""
    on_the_bus = [
        _long_options(_command(name))
        for name in _commands(main)
        if "--nats" in _long_options(_command(name))
    ]
    return set.intersection(*on_the_bus)


def _row(text: str, name: str) -> str:
    return next(
        line for line in text.splitlines() if line.startswith((f"| `{name} ", f"| `{name}`"))
    )


def _missing_options(text: str, options: set[str]) -> list[str]:
    return sorted(opt for opt in options if not re.search(rf"{re.escape(opt)}(?![\w-])", text))


def test_every_option_of_every_command_is_in_its_operations_row() -> None:
    operations = OPERATIONS.read_text()
    shared = _connection_options()
    assert {"--nats", "--fleet"} <= shared
    missing = {}
    for name in _commands(main):
        lacking = _missing_options(_row(operations, name), _long_options(_command(name)) - shared)
        if lacking:
            missing[name] = lacking
    assert missing == {}, f"options missing from their rows in docs/operations.md: {missing}"


def test_the_connection_and_global_options_are_in_the_operations_doc() -> None:
    operations = OPERATIONS.read_text()
    missing = _missing_options(operations, _connection_options() | _long_options(main))
    assert missing == [], f"options missing from docs/operations.md: {missing}"


@pytest.mark.parametrize(
    ("command", "flags"), [("agent", AGENT_FLAGS), ("coordinator", COORDINATOR_FLAGS)]
)
def test_every_flag_of_a_serving_process_is_in_its_operations_row(
    command: str, flags: tuple
) -> None:
    operations = OPERATIONS.read_text()
    row = next(
        line for line in operations.splitlines() if line.startswith(f"| `lorabus {command} ")
    )
    missing = [flag.name for flag in flags if not re.search(rf"{flag.name}(?![\w-])", row)]
    assert missing == [], f"lorabus {command} flags missing from its operations.md row: {missing}"
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
        worker_id={Role.AGENT: "w000", Role.TENANT: "a", Role.NODE: "n1"}.get(role),
        tenants=["a"],
        node_workers=["w000", "w001"] if role is Role.NODE else (),
    )
    missing = [s for s in (*granted.publish, *granted.subscribe) if f"`{s}`" not in security]
    assert missing == [], f"{role} permissions missing from docs/security.md: {missing}"


def test_the_operations_doc_draws_the_exception_tree_of_lorabus_errors() -> None:
    from lorabus import errors

    doc = errors.__doc__ or ""
    tree = doc[doc.index("    LorabusError") : doc.index("\n\n", doc.index("    LorabusError"))]
    operations = OPERATIONS.read_text()
    missing = [line.strip() for line in tree.splitlines() if line.strip() not in operations]
    assert missing == [], f"docs/operations.md's exception tree lacks: {missing}"


def test_the_readme_is_a_short_read() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/"


_STALE_FIGURES = {
    "a test count": re.compile(r"\b\d[\d,]*\s+(?:tests?|test cases)\b", re.IGNORECASE),
    "CI or test-run minutes": re.compile(
        r"\b(?:CI|pytest|test suite|tests?|tier)\b[^.\n]{0,80}\bminutes?\b", re.IGNORECASE
    ),
}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_gives_test_counts_or_ci_minutes(doc: Path) -> None:
    text = doc.read_text()
    found = [
        f"{what}: {match.group(0)!r}"
        for what, pattern in _STALE_FIGURES.items()
        for match in pattern.finditer(text)
    ]
    assert found == [], f"{doc.name} gives figures that go stale: {found}"


def test_the_readme_gives_no_durations_of_runs() -> None:
    readme = README.read_text()
    assert not re.search(r"\bminutes?\b", readme, re.IGNORECASE), "README.md names minutes"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    anchors = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_lands(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert broken == [], f"{doc.name} links to what is not there: {broken}"
