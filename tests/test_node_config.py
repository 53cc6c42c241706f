"""A node agent's file (``lorabus agent --node-file``): what each worker
takes from it, from ``[defaults]`` and from the command line, and the usage
errors for a file that cannot be right, given before anything connects."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lorabus.cli.main import main
from lorabus.cli.serve import _node_config
from lorabus.schemas.nodes import NODE_ENV

NODE = """\
node = "gpu-07"

[defaults]
engine = "vllm"
world_size = 2

[[workers]]
worker_id = "w000"
system_url = "http://127.0.0.1:8000"
engine = "sglang"
api_key_env = "NODE_TEST_KEY"
admin_api_key_env = "NODE_TEST_ADMIN"

[[workers]]
worker_id = "w001"
system_url = "http://127.0.0.1:8001"
world-size = 4
"""


@pytest.fixture(autouse=True)
def _no_node_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever identity the shell running the tests has loaded."""
    monkeypatch.delenv(NODE_ENV, raising=False)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return str(path)


def test_a_worker_takes_its_own_settings_then_the_defaults_then_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODE_TEST_KEY", "k0")
    monkeypatch.setenv("NODE_TEST_ADMIN", "admin0")
    flags = {"heartbeat_s": 0.5, "world_size": 8, "engine": "sglang"}
    fixed = {"fleet": "rl", "headers": {"X-Team": "a"}}

    node = _node_config(_write(tmp_path, NODE), flags, fixed, ("X-Team=a",))

    assert node.node == "gpu-07"
    w000, w001 = node.workers
    assert (w000.worker_id, w000.system_url, w000.world_size) == (
        "w000",
        "http://127.0.0.1:8000",
        2,
    )
    assert (w001.worker_id, w001.world_size) == ("w001", 4)
    assert (w000.engine, w001.engine) == ("sglang", "vllm")  # its own, then [defaults]
    assert {w.heartbeat_s for w in node.workers} == {0.5}  # from the flags
    assert {w.fleet for w in node.workers} == {"rl"}
    # A worker's key variable comes as --api-key-env would: beside the --header
    # flags, not instead of them; its admin key alone, as --admin-api-key-env.
    assert w000.headers == {"Authorization": "Bearer k0", "X-Team": "a"}
    assert w001.headers == {"X-Team": "a"}
    assert w000.admin_headers == {"Authorization": "Bearer admin0"}
    assert w001.admin_headers == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("node = 'n'\n", "list its workers"),
        ("[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\n", "give the node's name"),
        ("node = 'n'\ncolour = 1\n", "unknown key 'colour'"),
        ("node = 'n'\n[defaults]\nworker_id = 'w0'\n", "worker_id is one worker's"),
        (
            "node = 'n'\n[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\nspeed = 3\n",
            "unknown setting 'speed'",
        ),
        (
            "node = 'w0'\n[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\n",
            "has the name of one of its workers",
        ),
        (
            "node = 'n'\n" + "[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\n" * 2,
            "lists a worker twice",
        ),
        (
            "node = 'n'\n[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\nworld_size = 0\n",
            "worker 1",
        ),
        ("node = 'a.b'\n[[workers]]\nworker_id = 'w0'\nsystem_url = 'http://e'\n", "node name"),
        ("node = 'n'\n[[workers]\n", "node file"),
    ],
)
def test_a_file_that_cannot_be_right_is_a_usage_error_saying_what(
    tmp_path: Path, text: str, says: str
) -> None:
    path = _write(tmp_path, text)

    with pytest.raises(click.UsageError) as raised:
        _node_config(path, {}, {"fleet": "rl", "headers": {}}, ())

    assert says in str(raised.value), raised.value
    assert path in str(raised.value)


def test_the_command_refuses_a_bad_file_or_a_worker_flag_before_it_connects(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path, "node = 'n'\n")
    nowhere = ["--nats", "nats://127.0.0.1:1", "--fleet", "rl"]

    bad = CliRunner().invoke(main, ["agent", *nowhere, "--node-file", path])
    flag = CliRunner().invoke(
        main, ["agent", *nowhere, "--node-file", _write(tmp_path, NODE), "--worker-id", "w9"]
    )
    neither = CliRunner().invoke(main, ["agent", *nowhere])

    assert bad.exit_code == 2 and "list its workers" in bad.output, bad.output
    assert flag.exit_code == 2 and "leave out the flag" in flag.output, flag.output
    assert neither.exit_code == 2 and "--node-file" in neither.output, neither.output


def test_a_node_file_of_another_node_than_the_identitys_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its acks and beats would go out on subjects its identity may not
    publish on, and its workers would only look dead: refused at start."""
    identities = tmp_path / "auth"
    made = CliRunner().invoke(
        main,
        ["auth", "init", "--out", str(identities), "--fleet", "rl", "--no-tls",
         "--node", "gpu-07=w000,w001"],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    other = _write(tmp_path, NODE.replace('node = "gpu-07"', 'node = "gpu-08"'))
    # --identity loads the identity's variables into this process's environment.
    monkeypatch.setattr("os.environ", dict(os.environ))
    nowhere = ["--nats", "nats://127.0.0.1:1", "--fleet", "rl", "--node-file", other]

    refused = CliRunner().invoke(
        main, ["--identity", str(identities / "node-gpu-07"), "agent", *nowhere]
    )

    lone = CliRunner().invoke(
        main,
        ["--identity", str(identities / "node-gpu-07"), "agent", *nowhere[:4],
         "--worker-id", "w000", "--system-url", "http://127.0.0.1:9"],
    )  # fmt: skip

    assert refused.exit_code == 2, refused.output
    assert "names node 'gpu-08'" in refused.output
    assert "node 'gpu-07'" in refused.output
    # The node's identity as one lone agent: its acks would be refused too.
    assert lone.exit_code == 2, lone.output
    assert "--node-file" in lone.output and "gpu-07" in lone.output
