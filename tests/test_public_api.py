"""The public surface: what ``import lorabus`` offers, its version, its exceptions."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest
from processes import run_lorabus

import lorabus
from lorabus import errors
from lorabus.schemas import ErrorCode, ErrorInfo


def test_the_documented_names_import_from_the_package() -> None:
    from lorabus import (  # noqa: F401
        ErrorCode,
        LorabusError,
        RankMap,
        UpdateClient,
        UpdateMode,
        UpdateResult,
        UpdateStatus,
        __version__,
    )


def test_every_name_in_all_exists_and_nothing_private_is_exported() -> None:
    assert lorabus.__all__ == sorted(lorabus.__all__, key=lambda n: (n.startswith("_"), n))
    for name in lorabus.__all__:
        assert hasattr(lorabus, name), name
    assert not [n for n in lorabus.__all__ if n.startswith("_") and n != "__version__"]


def test_the_version_is_the_installed_distributions() -> None:
    assert lorabus.__version__ == importlib.metadata.version("lorabus")


async def test_the_cli_prints_the_version() -> None:
    finished = await run_lorabus("--version")
    assert finished.returncode == 0, finished
    assert finished.stdout.strip() == f"lorabus, version {lorabus.__version__}"


def _exception_classes() -> list[type[errors.LorabusError]]:
    return [
        member
        for _, member in inspect.getmembers(errors, inspect.isclass)
        if issubclass(member, BaseException) and member.__module__ == errors.__name__
    ]


def test_every_exception_is_a_lorabus_error_with_a_code_and_in_the_drawn_tree() -> None:
    tree = errors.__doc__ or ""
    for kind in _exception_classes():
        assert issubclass(kind, errors.LorabusError), kind
        assert isinstance(kind.code, ErrorCode), kind
        assert f" {kind.__name__} " in tree, f"{kind.__name__} is missing from the tree"


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (ErrorCode.BAD_REQUEST, errors.BadRequest),
        (ErrorCode.STALE_VERSION, errors.StaleVersion),
        (ErrorCode.ENGINE_ERROR, errors.EngineError),
        (ErrorCode.NO_COORDINATOR, errors.NoCoordinator),
        (ErrorCode.PERMISSION_DENIED, errors.PermissionDenied),
        (ErrorCode.BUS_UNREACHABLE, errors.BusUnreachable),
    ],
)
def test_an_error_received_as_data_becomes_its_exception(
    code: ErrorCode, kind: type[errors.LorabusError]
) -> None:
    raised = errors.LorabusError.from_info(ErrorInfo(code=code, message="why"))
    assert type(raised) is kind and str(raised) == "why"
    assert raised.info() == ErrorInfo(code=code, message="why")


def test_a_code_without_a_class_of_its_own_keeps_its_code_on_the_root() -> None:
    raised = errors.LorabusError.from_info(ErrorInfo(code=ErrorCode.PHASE_TIMEOUT, message="m"))
    assert type(raised) is errors.LorabusError
    assert raised.code is ErrorCode.PHASE_TIMEOUT
