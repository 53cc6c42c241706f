"""What an update id names: one update, by its content.

A repeated update id with the same content gets the first result; with
other content it is answered ``bad_request`` (``book.py``). The same content
means:

- the same adapter;
- the same directory (paths compared normalised, so ``/a/b/`` is ``/a/b``);
- a version that asks for what the first request was taken as: the same
  version, or none. A request without a version leaves the version to the
  coordinator, and for a known id the coordinator chose it when the first
  request ran; a request naming version N matches a first request that named
  N or named none and was run as N (known once it has run: until then it
  waits for that).

How the update runs is not part of it: a repeated id with another ``mode``,
``digest`` or ``keep`` gets the first result, as the first request ran it
(asked again after a failover, the request may come from a requester that
changed its defaults meanwhile; it still names the same update).
"""

from __future__ import annotations

import posixpath
import re

from lorabus.schemas import CommittedRecord, UpdateRequest, UpdateResult


def content_conflict(
    first: UpdateRequest,
    request: UpdateRequest,
    taken_as: int | None,
    *,
    version_known: bool = True,
) -> str | None:
    """Why ``request`` is not the same content as ``first``, the first request of
    its id (which ran as version ``taken_as``, if it ran); None when it is.
    ``version_known`` False: leave the version out (the first has not run yet)."""
    same_version = (
        not version_known
        or request.version is None
        or request.version == first.version
        or (first.version is None and request.version == taken_as)
    )
    if (
        first.adapter == request.adapter
        and posixpath.normpath(first.path) == posixpath.normpath(request.path)
        and same_version
    ):
        return None
    ran = f", run as version {taken_as}" if first.version is None and taken_as is not None else ""
    return _reused(request, f"{_content(first)}{ran}")


def result_conflict(
    request: UpdateRequest, result: UpdateResult, committed: CommittedRecord | None
) -> str | None:
    """Why ``request`` is not the content the id's ``result`` was for, as far as
    the result shows it (the first request is not known); None when it may be.

    A result names the adapter as requested or its served name, the version
    it ran as (none only if the first request named none and was refused
    before it was planned), and its path (a result stored by an older
    version has none: then the path is known only while the adapter's
    committed record is the result's version).
    """
    served = re.compile(rf"{re.escape(request.adapter)}-(?:r\d+-)?v{result.version}")
    same_adapter = result.adapter == request.adapter or bool(served.fullmatch(result.adapter))
    same_version = request.version is None or request.version == result.version
    path: str | None = result.path or None
    if (
        path is None
        and result.committed
        and committed is not None
        and committed.adapter == request.adapter
        and committed.version == result.version
    ):
        path = committed.path
    same_path = path is None or path == posixpath.normpath(request.path)
    if same_adapter and same_version and same_path:
        return None
    first = f"{result.adapter!r} version {result.version}"
    if path is not None:
        first += f" from {path}"
    return _reused(request, f"{first} ({result.status})")


def _reused(request: UpdateRequest, first: str) -> str:
    return (
        f"update id {request.update_id!r} was first used for {first}; this request is for "
        f"{_content(request)}. An update id names one update: use a new id for other "
        "content (the same content gets the first result)"
    )


def _content(request: UpdateRequest) -> str:
    version = (
        "no version (one past the committed)"
        if request.version is None
        else f"version {request.version}"
    )
    return f"{request.adapter!r} {version} from {request.path}"
