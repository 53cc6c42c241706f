"""How a connection's identity and link are chosen, before anything is sent:
one way to authenticate, secrets only from files and the environment, and no
credentials in the clear (or none at all) towards a host that is not loopback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lorabus import BusOptions, InsecureConnection

REMOTE = ["nats://nats.example.com:4222"]
LOOPBACK = ["nats://127.0.0.1:4222"]


@pytest.fixture
def seed_file(tmp_path: Path) -> str:
    from lorabus.security.auth_init import _new_user_seed

    path = tmp_path / "nkey.seed"
    path.write_bytes(_new_user_seed())
    return str(path)


def test_credentials_in_the_clear_to_a_remote_host_are_refused(seed_file: str) -> None:
    with pytest.raises(InsecureConnection, match=r"in the clear to nats\.example\.com"):
        BusOptions(nkey_seed_file=seed_file).nats_kwargs(REMOTE, environ={})
    with pytest.raises(InsecureConnection):
        BusOptions(user="u").nats_kwargs(REMOTE, environ={"LORABUS_NATS_PASSWORD": "p"})
    with pytest.raises(InsecureConnection):
        BusOptions().nats_kwargs(["nats://u:p@nats.example.com:4222"], environ={})


def test_no_credentials_to_a_remote_host_are_refused() -> None:
    with pytest.raises(InsecureConnection, match="no credentials"):
        BusOptions().nats_kwargs(REMOTE, environ={})


def test_insecure_allows_both(seed_file: str) -> None:
    assert BusOptions(insecure=True).nats_kwargs(REMOTE, environ={}) == {}
    kwargs = BusOptions(nkey_seed_file=seed_file, insecure=True).nats_kwargs(REMOTE, environ={})
    assert kwargs["nkeys_seed"] == seed_file


def test_tls_makes_credentials_to_a_remote_host_fine(seed_file: str) -> None:
    kwargs = BusOptions(nkey_seed_file=seed_file).nats_kwargs(
        ["tls://nats.example.com:4222"], environ={}
    )
    assert kwargs["tls"] is not None and kwargs["nkeys_seed"] == seed_file


def test_no_credentials_to_loopback_work_with_a_warning_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lorabus.bus.options._warned", set())
    with caplog.at_level(logging.WARNING, logger="lorabus.bus.options"):
        assert BusOptions().nats_kwargs(LOOPBACK, environ={}) == {}
        assert BusOptions().nats_kwargs(LOOPBACK, environ={}) == {}
    warnings = [r.message for r in caplog.records if "without credentials" in r.message]
    assert len(warnings) == 1, warnings


def test_one_way_to_authenticate(seed_file: str) -> None:
    with pytest.raises(ValueError, match="one way to authenticate"):
        BusOptions(nkey_seed_file=seed_file).nats_kwargs(
            LOOPBACK, environ={"LORABUS_NATS_TOKEN": "t"}
        )


def test_a_user_needs_a_password_from_the_environment() -> None:
    with pytest.raises(ValueError, match=r"\$LORABUS_NATS_PASSWORD"):
        BusOptions(user="u").nats_kwargs(LOOPBACK, environ={})
    kwargs = BusOptions(user="u").nats_kwargs(LOOPBACK, environ={"LORABUS_NATS_PASSWORD": "p"})
    assert (kwargs["user"], kwargs["password"]) == ("u", "p")


def test_an_nkeys_inbox_prefix_comes_from_its_public_key(seed_file: str) -> None:
    from lorabus.bus.options import inbox_prefix_for, public_key_of

    prefix = BusOptions(nkey_seed_file=seed_file).nats_kwargs(LOOPBACK, environ={})["inbox_prefix"]
    assert prefix == inbox_prefix_for(public_key_of(Path(seed_file).read_bytes()))
    explicit = BusOptions(nkey_seed_file=seed_file, inbox_prefix="_INBOX_me")
    assert explicit.nats_kwargs(LOOPBACK, environ={})["inbox_prefix"] == "_INBOX_me"


def test_the_options_hold_no_secret_to_print(seed_file: str) -> None:
    options = BusOptions.from_env(
        {
            "LORABUS_NATS_NKEY": seed_file,
            "LORABUS_NATS_PASSWORD": "hunter2",
            "LORABUS_NATS_TOKEN": "t0ken",
            "LORABUS_INSECURE": "true",
        }
    )
    shown = repr(options)
    assert options.insecure and options.nkey_seed_file == seed_file
    assert "hunter2" not in shown and "t0ken" not in shown
    assert Path(seed_file).read_text().strip() not in shown


def test_a_certificate_needs_its_key(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="needs its key"):
        BusOptions(tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="not a readable file"):
        BusOptions(nkey_seed_file=str(tmp_path / "missing"))
