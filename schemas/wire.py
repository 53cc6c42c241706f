"""What every wire message shares: the wire version, the tagged base Struct,
the phases of an update.

The messages themselves are in the module of their kind: :mod:`.commands`
(coordinator -> agents), :mod:`.reports` (agents -> coordinator: acks and
heartbeats), :mod:`.requests` (orchestrator and operator <-> coordinator),
:mod:`.events` (anyone -> the audit tap) and :mod:`.records` (the fleet's
state in KV). Each subject family has one tagged union (``type`` is the tag)
so a receiver decodes with one reused Decoder and dispatches with ``match``.
Every message has a version field ``v``; new fields get defaults and field
types never change, so an older peer ignores what it does not know (msgspec
drops unknown fields).
"""

from __future__ import annotations

import enum

import msgspec

WIRE_VERSION = 11
"""2: commands address a pause's cohort and committed notices reach every
agent; a version-1 agent acts only on commands that name it, so in an
upgrade the agents go first and the coordinators last.
3: a pause carries the load that follows it (``PauseCommand.then_load``); a
version-2 agent only pauses, and loads when the load is sent again by name,
at its first re-send.
4: a pause carrying a load may ask for the pause's ack to come with the
load's (``LoadSpec.ack_hold_s``, ``Ack.with_pause``); a version-3 agent acks
both on their own, as before.
5: a command sent to one worker by name names the agent process it is for
(``instance``), and an agent that checks signatures refuses one of this
version for another process, or for none, so that no command captured
before it started can drive it; it takes a named command without one from
a version-4 coordinator, so in an upgrade the agents still go first.
6: an adapter may come from the fleet's object store (a ``bus:<digest>``
path), which agents fetch in a ``prepare`` phase before any engine is
paused; a version-5 agent refuses such a path, so the agents go first
again, and requesters use ``bus:`` paths only once every agent runs 6.
7: agents converge on every adapter's committed version and the versions
kept beside it (``CommittedRecord.kept``, read from KV, and a committed
notice's ``adapter`` and ``kept``); a version-6 agent converges on the
newest commit only. A request may ask for its adapter's ``keep``, and a
status lists every adapter (``FleetStatus.adapters``); a version-6 peer
ignores both.
8: placement: a request may ask for ``replicas`` and a ``selector`` over
the labels heartbeats announce (``Heartbeat.labels``), and a commit point
and its notice list the workers placed (``workers``); a version-7 agent
would load every adapter everywhere, so a coordinator refuses a placed
update while any live agent beats with an older version.
9: each tenant has an adapter store of its own, whose objects a path names
``bus:<tenant>/<digest>``; a version-8 agent refuses such a path, so a
coordinator refuses an update from a tenant's store while any live agent
beats with an older version.
10: a canary phase: after the load (live mode) or the resume (pause mode),
each member asks its own engine for one token with the new served name
(``CanaryCommand``); a version-9 agent does not know the command, so a
coordinator asks only members of version 10 or later, and says whom it
did not ask.
11: node agents: one process acks and beats for several workers of its
node in one message (``NodeAcks``, ``NodeBeats``) on the subjects of the
node's name; a version-10 coordinator drops those as malformed, so in an
upgrade the coordinators go first."""

PLACED_SINCE = 8
"""The wire version from which an agent loads only what is placed on it."""
TENANT_STORES_SINCE = 9
"""The wire version from which an agent fetches from a tenant's store."""
CANARY_SINCE = 10
"""The wire version from which an agent runs a canary generation."""

INSTANCE_BOUND_SINCE = 5
"""The wire version from which a command sent by name carries ``instance``."""


class Phase(enum.StrEnum):
    """The phases of one update, in the order they run."""

    QUORUM = "quorum"
    PREPARE = "prepare"
    """Agents fetch an adapter from the fleet's object store (``bus:`` paths)."""
    PAUSE = "pause"
    LOAD = "load"
    VERIFY = "verify"
    RESUME = "resume"
    CANARY = "canary"
    """One generation with the new served name: on every member's own engine,
    then once through the frontend (after the resume in pause mode)."""
    UNLOAD = "unload"


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = WIRE_VERSION


def tag_of(message: msgspec.Struct) -> str:
    """The ``type`` tag a message is sent with (a command's tag is its phase)."""
    tag = type(message).__struct_config__.tag
    assert isinstance(tag, str), "every wire message has a string tag"
    return tag
