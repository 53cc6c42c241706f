"""Auth options turn into the same headers for every engine and frontend call."""

from __future__ import annotations

import pytest

from lorabus.cli.headers import auth_headers


def test_the_api_key_becomes_a_bearer_header_plus_extra_headers() -> None:
    headers = auth_headers("KEY", ["X-Team=rl", "X-Empty="], environ={"KEY": "s3cret"})

    assert headers == {"Authorization": "Bearer s3cret", "X-Team": "rl", "X-Empty": ""}


@pytest.mark.parametrize("environ", [{}, {"KEY": "EMPTY"}])
def test_an_unset_or_empty_key_sends_no_authorization(environ: dict[str, str]) -> None:
    assert auth_headers("KEY", [], environ=environ) == {}


@pytest.mark.parametrize("bad", ["NoEquals", "=value", "Bad Name=x", "a:b=c"])
def test_a_malformed_header_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="NAME=VALUE"):
        auth_headers(None, [bad])
