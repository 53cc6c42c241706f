"""What the fleet has committed, adapter by adapter: the state an agent converges on.

The fleet's committed state is, for every adapter, its committed version and
the versions kept beside it (``CommittedRecord.kept``): every engine serves
all of them. An agent learns it from the fleet's KV (each adapter's commit
point, ``committed.<adapter>``, and the fleet's latest commit, ``committed``)
and from ``committed`` notices, and its engine must hold every served name of
it before the agent says it is ready (:mod:`~lorabus.agents.convergence`).

The rules, kept here as plain functions of what was learnt, so that each can
be checked on its own:

- Per adapter, only forward: a record or notice replaces what the agent
  knows of its adapter unless that is newer by (lineage, version); a reset
  starts a later lineage, whose versions may be lower.
- A notice that names its adapter (wire version 7) brings the versions kept
  beside it; one that does not (``adapter == ""``, a version-6 coordinator's)
  is placed by its served name (:func:`adapter_of_notice`) and says nothing of
  kept versions: a new version of the adapter requires only itself until the
  next read of KV; the same version keeps what was known beside it.
- An adapter whose commit point is gone at a read (a reset) is no longer
  required, unless it was learnt after that read began (a notice overtaking
  the read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import msgspec

from lorabus.schemas import CommittedNotice

COMMITTED_KEY = "committed"
"""The fleet's latest commit, of any adapter."""
COMMIT_POINTS = f"{COMMITTED_KEY}.>"
"""The keys of every adapter's commit point, ``committed.<adapter>``."""

UNREADY_REASON_MAX = 4096
"""A heartbeat's ``unready_reason`` is at most this long (schemas/reports.py)."""
_VERSIONED = re.compile(r"(?P<adapter>.+?)(?:-r(?P<lineage>\d+))?-v(?P<version>\d+)")
"""A versioned served name: ``<adapter>-v<n>``, after a reset
``<adapter>-r<lineage>-v<n>`` (no adapter name ends like ``-r<n>``: the
coordinator refuses one)."""
_NAMED_AT_MOST = 4
"""Missing names an unready reason spells out; the rest are counted."""


class KeptView(msgspec.Struct, frozen=True):
    """A version kept beside the committed one, as a record carries it. Every
    field has a default so that a record of another wire version (whose kept
    versions lack a served name or a path) still decodes: such an entry is
    skipped, not the record."""

    version: int = 0
    served_name: str = ""
    path: str = ""
    digest: str = ""


class CommittedView(msgspec.Struct):
    """The part of a committed record an agent needs (the rank map is skipped
    unbuilt: at 1024 workers it is most of the record's 57 KB)."""

    served_name: str
    path: str
    version: int
    adapter: str = ""
    lineage: int = 0
    digest: str = ""
    kept: list[KeptView] = []
    workers: list[str] = []


COMMITTED_VIEW = msgspec.json.Decoder(CommittedView)


class Wanted(msgspec.Struct, frozen=True):
    """One served name the engine must hold, and where to load it from."""

    adapter: str
    served_name: str
    path: str
    version: int
    digest: str = ""
    """The bytes that were committed ("": nobody could read them)."""
    kept: bool = False
    """An earlier version kept beside the committed one."""


class Target(msgspec.Struct, frozen=True):
    """One adapter as the fleet has committed it."""

    adapter: str
    served_name: str
    path: str
    version: int
    lineage: int = 0
    digest: str = ""
    kept: tuple[Wanted, ...] = ()
    workers: tuple[str, ...] = ()
    """The workers placed to serve it (): every worker."""

    def placed_on(self, worker_id: str) -> bool:
        return not self.workers or worker_id in self.workers

    @property
    def order(self) -> tuple[int, int]:
        """Later lineages first, then later versions."""
        return (self.lineage, self.version)

    def wanted(self) -> list[Wanted]:
        """The committed version, then those kept beside it, newest first."""
        committed = Wanted(
            adapter=self.adapter,
            served_name=self.served_name,
            path=self.path,
            version=self.version,
            digest=self.digest,
        )
        return [committed, *self.kept]


def _kept(adapter: str, versions: Iterable[KeptView], committed_name: str) -> tuple[Wanted, ...]:
    kept: list[Wanted] = []
    names = {committed_name}
    for v in versions:
        if v.served_name and v.path and v.served_name not in names:
            names.add(v.served_name)
            kept.append(
                Wanted(
                    adapter=adapter,
                    served_name=v.served_name,
                    path=v.path,
                    version=v.version,
                    digest=v.digest,
                    kept=True,
                )
            )
    return tuple(kept)


def target_of_record(adapter: str, record: CommittedView) -> Target:
    """``adapter``'s target from its commit point (or the latest record)."""
    return Target(
        adapter=adapter,
        served_name=record.served_name,
        path=record.path,
        version=record.version,
        lineage=record.lineage,
        digest=record.digest,
        kept=_kept(adapter, record.kept, record.served_name),
        workers=tuple(record.workers),
    )


def target_of_notice(adapter: str, notice: CommittedNotice) -> Target:
    kept = (KeptView(k.version, k.served_name, k.path, k.digest) for k in notice.kept)
    return Target(
        adapter=adapter,
        served_name=notice.served_name,
        path=notice.path,
        version=notice.version,
        lineage=notice.lineage,
        digest=notice.digest,
        kept=_kept(adapter, kept, notice.served_name),
        workers=tuple(notice.workers),
    )


def adapter_of_notice(notice: CommittedNotice, known: Mapping[str, Target]) -> str:
    """The adapter a notice commits. A version-6 coordinator's names none: it
    is the adapter known to serve that name already, else the name less the
    version the coordinator's naming adds (``<adapter>-v<version>``, after a
    reset ``<adapter>-r<lineage>-v<version>``), else the name itself (fixed
    naming serves an adapter under its own name)."""
    if notice.adapter:
        return notice.adapter
    for target in known.values():
        if target.served_name == notice.served_name:
            return target.adapter
    suffix = f"-r{notice.lineage}-v{notice.version}" if notice.lineage else f"-v{notice.version}"
    stem = notice.served_name.removesuffix(suffix)
    return stem if stem and stem != notice.served_name else notice.served_name


class DesiredState:
    """Every adapter's target, as this agent has learnt them; what its engine
    must serve, those placed on its worker (every worker, unless placed)."""

    def __init__(self, worker_id: str = "") -> None:
        self._worker_id = worker_id
        self._targets: dict[str, Target] = {}
        self._learnt_at: dict[str, int] = {}
        """Adapter -> the learning (a count) that last set it."""
        self._learnings = 0
        self._view: _View | None = None
        """What the targets imply, computed once per change of them: every
        notice and beat asks, and at 32 adapters recomputing it each time was
        a third of an agent's CPU."""

    @property
    def targets(self) -> Mapping[str, Target]:
        return self._targets

    @property
    def learnings(self) -> int:
        """How many targets have been learnt so far: a read that begins at
        ``n`` forgets nothing learnt after ``n`` (:meth:`forget_unseen`)."""
        return self._learnings

    def learn(self, target: Target, *, kept_known: bool = True) -> bool:
        """Take ``target`` unless what is known of its adapter is newer.
        ``kept_known`` False (a version-6 notice): it says nothing of the kept
        versions, so the same version keeps those known beside it."""
        known = self._targets.get(target.adapter)
        if known is not None:
            if target.order < known.order:
                return False
            if not kept_known and known.served_name == target.served_name:
                target = msgspec.structs.replace(target, kept=known.kept)
        self._learnings += 1
        self._targets[target.adapter] = target
        self._learnt_at[target.adapter] = self._learnings
        self._view = None
        return True

    def forget_unseen(self, seen: Iterable[str], *, learnt_before: int) -> list[str]:
        """Forget the adapters a read of KV did not find (reset since), unless
        learnt after the read began; the adapters forgotten."""
        keep = set(seen)
        gone = [
            adapter
            for adapter in self._targets
            if adapter not in keep and self._learnt_at[adapter] <= learnt_before
        ]
        for adapter in gone:
            del self._targets[adapter]
            del self._learnt_at[adapter]
        if gone:
            self._view = None
        return sorted(gone)

    def wanted(self) -> list[Wanted]:
        """Every served name the engine must hold: each adapter's committed
        version first (by adapter), then the kept ones; a name once."""
        return list(self._current().wanted)

    def names(self) -> frozenset[str]:
        return self._current().names

    def committed_names(self) -> frozenset[str]:
        """Each adapter's committed served name, of those placed here."""
        return self._current().committed

    def _current(self) -> _View:
        if self._view is None:
            self._view = _View.of(self._targets, self._worker_id)
        return self._view

    def stale(self, held: Iterable[str]) -> list[str]:
        """The names of ``held`` an engine may give up to make room, oldest
        first: versions of a committed adapter older than its committed one
        (of its lineage) that it does not keep, and those :meth:`unplaced`
        names. Nothing else: not a version of an adapter no commit names,
        nor one newer than the committed (an update may be loading it now)."""
        required = self.names()
        found: list[tuple[int, str]] = []
        for name in held:
            seen = None if name in required else self._version_of(name)
            if seen is None:
                continue
            target, lineage, version = seen
            if not target.placed_on(self._worker_id):
                if (lineage, version) <= target.order:
                    found.append((-1, name))
            elif lineage == target.lineage and version < target.version:
                found.append((version, name))
        return [name for _, name in sorted(found)]

    def unplaced(self, held: Iterable[str], adapter: str | None = None) -> list[str]:
        """The names of ``held`` to unload because their adapter (``adapter``,
        or any) is placed on other workers: its versions of any earlier
        lineage, and of its own up to the committed one (a newer one may be
        what an update that places it here is loading now)."""
        if not self._current().elsewhere:
            return []
        found = []
        for name in held:
            seen = self._version_of(name)
            if seen is None or (adapter is not None and seen[0].adapter != adapter):
                continue
            target, lineage, version = seen
            if not target.placed_on(self._worker_id) and (lineage, version) <= target.order:
                found.append(name)
        return sorted(found)

    def _version_of(self, name: str) -> tuple[Target, int, int] | None:
        """The target of the adapter ``name`` is a versioned served name of,
        with the name's lineage and version; None for any other name. One
        parse and one look-up, whatever the number of adapters."""
        found = _VERSIONED.fullmatch(name)
        if found is None:
            return None
        target = self._targets.get(found["adapter"])
        if target is None:
            return None
        return target, int(found["lineage"] or 0), int(found["version"])

    def missing(self, held: Iterable[str]) -> list[Wanted]:
        """What the engine must hold and does not, in :meth:`wanted`'s order."""
        have = set(held)
        return [w for w in self._current().wanted if w.served_name not in have]


class _View(msgspec.Struct, frozen=True):
    """What an agent's targets imply for its engine."""

    wanted: tuple[Wanted, ...]
    names: frozenset[str]
    committed: frozenset[str]
    """Each adapter's committed served name, of those placed here."""
    elsewhere: bool
    """Some adapter is placed on other workers only."""

    @classmethod
    def of(cls, targets: Mapping[str, Target], worker_id: str) -> _View:
        here = [targets[a] for a in sorted(targets) if targets[a].placed_on(worker_id)]
        ordered = [t.wanted()[0] for t in here] + [k for t in here for k in t.kept]
        seen: set[str] = set()
        unique = []
        for wanted in ordered:
            if wanted.served_name not in seen:
                seen.add(wanted.served_name)
                unique.append(wanted)
        return cls(
            wanted=tuple(unique),
            names=frozenset(seen),
            committed=frozenset(t.served_name for t in here),
            elsewhere=len(here) < len(targets),
        )


def unready_text(missing: list[Wanted], failures: Mapping[str, tuple[int, str]]) -> str:
    """An unready reason that names what is missing (``missing policy-v1
    (adapter policy)``) and why its reloads failed, the most failed first,
    the first few by name and the rest counted, within a heartbeat's bound."""
    ranked = sorted(missing, key=lambda w: -failures.get(w.served_name, (0, ""))[0])
    shown = ranked[:_NAMED_AT_MOST]
    # Each named one gets an equal share, so that the count of the rest fits.
    room = (UNREADY_REASON_MAX - 64) // max(len(shown), 1) - 2
    parts = []
    for wanted in shown:
        part = f"missing {wanted.served_name} (adapter {wanted.adapter})"
        count, why = failures.get(wanted.served_name, (0, ""))
        if count:
            times = "once" if count == 1 else f"{count} times"
            part += f": loading it failed {times}: {why}"
        parts.append(part[:room])
    if len(ranked) > len(shown):
        parts.append(f"and {len(ranked) - len(shown)} more missing")
    return "; ".join(parts)[:UNREADY_REASON_MAX]
