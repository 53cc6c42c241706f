"""From an update request to a plan: validation, served names and retention.

Everything here is pure but one look at the filesystem, so the rules a request
must meet are tested without a bus: name syntax, an absolute path (under the
configured roots) or an object of the fleet's store (``bus:<digest>``), a
version not older than the committed one, and the served name for the
naming policy, and how many of the adapter's versions engines keep serving
after its commit (the request's ``keep``, else the coordinator's ``--keep``;
:func:`retired_names` is what the retire step then unloads).

A request is checked once, as it arrives (:func:`check_request`): what holds
whatever is committed (its name, its path, its mode, its keep). The rest
depends on the committed state, which may move while the request waits in
the queue (a version of none means one past the committed one when it runs),
so the plan is made once, when it runs (:meth:`CheckedRequest.plan`); on
arrival only its version is checked against what is committed then
(:meth:`CheckedRequest.version`).

The roots check resolves symlinks where it can: if the path exists on the
coordinator's host, its real path must lie under one of the roots' real
paths; if not, the normalized text must lie under a root, and each agent,
which checks the path again on its own host, has the last word. The planned
path stays the requested one (normalized), since hosts may mount adapters
differently. The look is made only when roots are set, costs a few ``lstat``
calls, and is isolated in :func:`_visible_realpath`; the coordinator makes it
off its event loop, under a deadline (:func:`check_request_off_loop`).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
from collections.abc import Collection, Iterable

import msgspec

from lorabus.adapters.bus_paths import digest_of
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.placement import Placement, Served
from lorabus.errors import BadRequest, StaleVersion
from lorabus.schemas import CommittedRecord, Naming, UpdateMode, UpdateRequest
from lorabus.schemas.bounds import MAX_KEEP

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$")
_LINEAGE_SUFFIX = re.compile(r"-r\d+\Z")
RESOLVE_DEADLINE_S = 5.0


class UpdatePlan(msgspec.Struct, frozen=True, kw_only=True):
    update_id: str
    adapter: str
    version: int
    path: str
    served_name: str
    replace: bool
    lineage: int = 0
    digest: str | None = None
    """The content digest every member must see at ``path`` (None: they must agree)."""
    live: bool = False
    """Load and verify without pausing any engine (``UpdateMode.LIVE``)."""
    keep: int
    """How many of the adapter's newest versions, this one among them, engines
    serve once it commits (``CheckedRequest.keep``)."""
    shared_with: list[str] = []
    """The other updates of its pause-mode round, whose pause it shares (``book.py``)."""
    beside: list[Served] = []
    """What engines serve while it runs, besides its new version: every
    adapter's committed and kept versions, where placed (``capacity.py``)."""
    placement: Placement = Placement()
    """On which workers it goes (``placement.py``; by default every worker)."""
    placed_on: list[str] = []
    """The workers the adapter's commit point lists now ([]: every worker,
    or nothing committed): a placed update prefers them."""
    previous: list[str] = []
    """The adapter's served names committed now, newest first: its
    committed version, then those kept beside it."""

    @property
    def own_names(self) -> list[str]:
        """What a worker serving the adapter holds once this commits: its new
        version, and the newest of the versions committed now it keeps."""
        older = [name for name in self.previous if name != self.served_name]
        return [self.served_name, *older[: self.keep - 1]]


class CheckedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An update request that passed the checks that hold whatever is committed."""

    request: UpdateRequest
    path: str
    """The request's path, normalized (and under the adapter roots, if set)."""
    live: bool
    """Load and verify without pausing any engine (``UpdateMode.LIVE``)."""
    replace: bool
    """Fixed naming: the load replaces what the adapter's own name serves."""
    keep: int
    """How many of the adapter's newest versions, this one among them, engines
    serve once it commits: the request's ``keep``, else the coordinator's
    ``--keep``. Not part of what an update id names (``book.py``)."""
    placement: Placement = Placement()

    @property
    def update_id(self) -> str:
        return self.request.update_id

    @property
    def adapter(self) -> str:
        return self.request.adapter

    def version(self, committed: CommittedRecord | None) -> int:
        """The version it runs as, against ``committed``: raises StaleVersion
        for an older one, BadRequest for the committed one from another path."""
        return _checked_version(self.request, committed, self.path)

    def plan(self, committed: CommittedRecord | None, lineage: int = 0) -> UpdatePlan:
        """The plan against what is committed now, in the adapter's ``lineage``
        (how many times its committed state was reset)."""
        version = self.version(committed)
        request = self.request
        return UpdatePlan(
            update_id=request.update_id,
            adapter=request.adapter,
            version=version,
            path=self.path,
            served_name=(
                request.adapter
                if self.replace
                else versioned_name(request.adapter, lineage, version)
            ),
            replace=self.replace,
            lineage=lineage,
            digest=request.digest or digest_of(self.path),
            live=self.live,
            keep=self.keep,
            placement=self.placement,
            placed_on=list(committed.workers) if committed is not None else [],
            previous=_served_names(committed) if committed is not None else [],
        )


def check_request(request: UpdateRequest, config: CoordinatorConfig) -> CheckedRequest:
    """Check what ``request`` must meet whatever is committed: its update id
    and adapter name, its path (under the roots), its mode and its keep for
    the naming."""
    if not request.update_id or len(request.update_id) > 128:
        raise BadRequest("update_id must be 1-128 characters")
    if not _NAME.match(request.adapter) or ".." in request.adapter or "//" in request.adapter:
        raise BadRequest(
            f"adapter name {request.adapter!r} is not valid: use letters, digits and "
            "'.', '_', '-', '/' (not at either end), at most 128 characters"
        )
    if _LINEAGE_SUFFIX.search(request.adapter):
        raise BadRequest(
            f"adapter name {request.adapter!r} ends like a reset lineage (-r<number>), "
            "which served names use after a reset: choose another name"
        )
    path = _checked_source(request, config.adapter_roots)
    live = (request.mode or config.mode) is UpdateMode.LIVE
    if live and config.naming is not Naming.VERSIONED:
        raise BadRequest(
            "live mode needs versioned naming: this coordinator serves fixed names, "
            "which cannot be replaced while engines serve them"
        )
    replace = config.naming is not Naming.VERSIONED
    if request.keep is not None and not 1 <= request.keep <= MAX_KEEP:
        raise BadRequest(f"keep must be 1 to {MAX_KEEP}, got {request.keep}")
    if replace and request.keep is not None and request.keep > 1:
        raise BadRequest(
            f"keep {request.keep} needs versioned naming: this coordinator serves fixed "
            "names, one version of each adapter"
        )
    placement = Placement(replicas=request.replicas, selector=dict(request.selector))
    if not placement.everywhere and not live:
        raise BadRequest(
            "placement (replicas or a selector) runs in live mode only: ask for mode live "
            "(lorabus update --mode live)"
        )
    return CheckedRequest(
        request=request,
        path=path,
        live=live,
        replace=replace,
        keep=config.keep if request.keep is None else request.keep,
        placement=placement,
    )


def _served_names(committed: CommittedRecord) -> list[str]:
    return [committed.served_name, *(k.served_name for k in committed.kept if k.served_name)]


def versioned_name(adapter: str, lineage: int, version: int) -> str:
    """``<adapter>-v<version>``; after a reset ``<adapter>-r<lineage>-v<version>``,
    so no name of a new lineage is one an engine may still hold from before."""
    if lineage:
        return f"{adapter}-r{lineage}-v{version}"
    return f"{adapter}-v{version}"


async def check_request_off_loop(
    request: UpdateRequest, config: CoordinatorConfig
) -> CheckedRequest:
    """:func:`check_request`, with its look at the filesystem (made only when
    roots are set) in a thread under a deadline: a hung network mount must
    not stall the coordinator's event loop, nor a request forever."""
    if not config.adapter_roots:
        return check_request(request, config)
    try:
        async with asyncio.timeout(RESOLVE_DEADLINE_S):
            return await asyncio.to_thread(check_request, request, config)
    except TimeoutError:
        raise BadRequest(
            f"could not resolve adapter path {request.path!r} within {RESOLVE_DEADLINE_S:g} s "
            "on the coordinator's host (a hung filesystem?)"
        ) from None


def is_committed(committed: CommittedRecord, version: int, path: str) -> bool:
    """Whether ``committed`` is exactly ``version`` from ``path``: asked for
    again, it is answered committed without touching an engine."""
    return (committed.version, committed.path) == (version, path)


def own_names(adapter: str, names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are ``adapter``'s served names: its versioned
    names of any lineage, and the adapter's own name (fixed naming)."""
    pattern = re.compile(rf"^{re.escape(adapter)}(?:-(?:r\d+-)?v\d+)?\Z")
    # The prefix first: an engine's list holds every tenant's names, most not
    # the adapter's, and a regular expression per name cost N x T of them.
    return [name for name in names if name.startswith(adapter) and pattern.match(name)]


def retired_names(adapter: str, loaded: Iterable[str], served: Collection[str]) -> list[str]:
    """What the retire step of a commit of ``adapter`` unloads: its versioned
    names among ``loaded`` (what the engines hold) that are not ``served``
    (the committed served name and those kept beside it), oldest first, by
    (lineage, version). Names of other adapters never match, so no commit
    retires another adapter's committed or kept versions."""
    pattern = re.compile(rf"^{re.escape(adapter)}-(?:r(\d+)-)?v(\d+)\Z")
    versions = sorted(
        (int(m.group(1) or 0), int(m.group(2)), name)
        for name in set(loaded)
        if name not in served and (m := pattern.match(name))
    )
    return [name for _, _, name in versions]


def _checked_source(request: UpdateRequest, roots: list[str]) -> str:
    """A filesystem path (see :func:`_checked_path`), or a ``bus:<digest>``
    path: the fleet's object store, which roots do not apply to; a digest
    the request also gives must be the one the path names."""
    try:
        stored = digest_of(request.path)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if stored is None:
        return _checked_path(request.path, roots)
    if request.digest is not None and request.digest != stored:
        raise BadRequest(
            f"the request's digest {request.digest} is not the one its path names ({stored})"
        )
    return request.path


def _checked_path(path: str, roots: list[str]) -> str:
    if not path or "\0" in path or not posixpath.isabs(path):
        raise BadRequest(f"adapter path {path!r} must be an absolute directory path")
    normal = posixpath.normpath(path)
    if not roots:
        return normal
    real = _visible_realpath(normal)
    if real is None:  # not on this host: the text, then each agent on its own
        inside = any(_is_within(normal, posixpath.normpath(root)) for root in roots)
    else:
        inside = any(_is_within(real, os.path.realpath(root)) for root in roots)
    if not inside:
        shown = path if real in (None, normal) else f"{path} (resolved: {real})"
        raise BadRequest(f"adapter path {shown!r} is outside the adapter roots {roots}")
    return normal


def _visible_realpath(path: str) -> str | None:
    """``path`` with its symlinks resolved, or None if this host cannot see it."""
    try:
        return os.path.realpath(path, strict=True)
    except OSError:
        return None


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _checked_version(request: UpdateRequest, committed: CommittedRecord | None, path: str) -> int:
    if request.version is None:
        return 1 if committed is None else committed.version + 1
    if request.version < 0:
        raise BadRequest(f"version must be >= 0, got {request.version}")
    if committed is None:
        return request.version
    if request.version < committed.version:
        raise StaleVersion(
            f"version {request.version} of {request.adapter!r} is older than the "
            f"committed version {committed.version}"
        )
    if request.version == committed.version and path != committed.path:
        raise BadRequest(
            f"version {request.version} of {request.adapter!r} is already committed "
            f"from {committed.path}; a different path needs a new version"
        )
    return request.version
