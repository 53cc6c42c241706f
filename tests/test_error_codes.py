"""Every error code comes back as its one class, and every class as itself or
the class whose code it carries: a code is set by one class only."""

from __future__ import annotations

import inspect

import pytest

from lorabus import errors
from lorabus.errors import LorabusError
from lorabus.schemas import ErrorCode, ErrorInfo

CLASSES = [
    member
    for _, member in inspect.getmembers(errors, inspect.isclass)
    if issubclass(member, LorabusError) and member.__module__ == errors.__name__
]
SETTERS = [kind for kind in CLASSES if "code" in vars(kind)]
"""The classes that set a code of their own: each is the class of that code."""
CLASS_OF = {kind.code: kind for kind in SETTERS}


def test_no_two_classes_set_the_same_code() -> None:
    assert sorted(kind.__name__ for kind in SETTERS) == sorted(
        kind.__name__ for kind in CLASS_OF.values()
    )


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_round_trips_through_from_info(code: ErrorCode) -> None:
    info = ErrorInfo(code=code, message="why")

    raised = LorabusError.from_info(info)

    assert type(raised) is CLASS_OF.get(code, LorabusError)
    assert raised.code is code and str(raised) == "why"
    assert raised.info() == info


@pytest.mark.parametrize("kind", CLASSES, ids=lambda kind: kind.__name__)
def test_every_class_comes_back_as_itself_or_the_class_of_its_code(
    kind: type[LorabusError],
) -> None:
    sent = kind("why").info()

    back = LorabusError.from_info(sent)

    # An ``except`` for the class that comes back catches the one that was sent.
    assert isinstance(kind("why"), type(back))
    assert back.info() == sent
    if kind in SETTERS:
        assert type(back) is kind


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (ErrorCode.DIGEST_MISMATCH, errors.DigestMismatch),
        (ErrorCode.DUPLICATE_WORKER, errors.DuplicateWorker),
        (ErrorCode.NOT_LISTED, errors.NotListed),
        (ErrorCode.BUSY, errors.Busy),
        (ErrorCode.QUORUM_TIMEOUT, errors.QuorumNotReached),
        (ErrorCode.VERIFY_TIMEOUT, errors.FrontendUnverified),
        (ErrorCode.INTERNAL, LorabusError),
    ],
)
def test_codes_of_classes_outside_the_first_map_find_their_class(
    code: ErrorCode, kind: type[LorabusError]
) -> None:
    assert type(LorabusError.from_info(ErrorInfo(code=code, message="m"))) is kind


def test_an_insecure_connection_is_caught_as_a_bus_error_and_as_a_bad_request() -> None:
    insecure = errors.InsecureConnection("credentials in the clear")

    assert isinstance(insecure, errors.BusError) and isinstance(insecure, errors.BadRequest)
    assert insecure.code is ErrorCode.BAD_REQUEST


def test_a_missing_audit_stream_is_caught_as_no_coordinator() -> None:
    missing = errors.AuditStreamMissing("no audit stream yet")

    assert isinstance(missing, errors.NoCoordinator)
    assert missing.code is ErrorCode.NO_COORDINATOR


def test_every_exception_class_is_exported() -> None:
    assert {kind.__name__ for kind in CLASSES} <= set(errors.__all__)
