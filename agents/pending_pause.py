"""A pause sent to the engine and not answered yet, recorded on the node's disk.

An agent killed while its engine's pause call is in flight leaves a request
the engine may still carry out later (a slow engine does, whether or not
its caller still waits): after its successor started and resumed the
engine, so that the engine ends up paused with nobody holding it. The
successor cannot see that request, so the agent writes it down before
sending it: ``.pauses/<fleet>.<worker>.json`` in the node's adapter cache
directory holds the wall-clock time until which the pause may still land,
as long as a live agent would resume the engine after a pause of its own
that went unanswered: the engine's call timeout, then the pause's lease
(the lease of an unanswered pause runs longer by the call timeout,
``command_queue.py``)::

    {"until": 1733402400.5}

An answer (the engine paused, or refused with a status) removes the record;
a pause that went unanswered leaves it, for a successor. A successor that
finds a time still to come treats its engine as maybe paused until then, as
it would its own unanswered pause: it resumes it at every beat, and reports
it paused meanwhile (``Agent._expect_predecessor_pause``).

A record is written whole and renamed over the old one, so a reader sees one
or the other; one that cannot be read or written is logged and counts as
none (a successor then resumes only at its start, as without the record).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time

from lorabus.agents.config import MAX_PAUSE_LEASE_S

log = logging.getLogger(__name__)


class PendingPause:
    """The record of one worker's pause in flight, at ``path``."""

    def __init__(self, path: str, late_s: float, max_lease_s: float = MAX_PAUSE_LEASE_S) -> None:
        """``late_s``: the engine's call timeout; ``max_lease_s``: the longest
        pause lease the agent grants."""
        self.path = path
        self.late_s = late_s
        self.max_lease_s = max_lease_s

    @classmethod
    def in_cache(
        cls, cache_dir: str, holder: str, late_s: float, max_lease_s: float = MAX_PAUSE_LEASE_S
    ) -> PendingPause:
        return cls(os.path.join(cache_dir, ".pauses", f"{holder}.json"), late_s, max_lease_s)

    @property
    def longest_s(self) -> float:
        return self.late_s + self.max_lease_s

    def sent(self, lease_s: float) -> None:
        """A pause of lease ``lease_s`` is about to be sent: it may land until
        the call timeout and that lease from now."""
        until = time.time() + self.late_s + min(max(lease_s, 0.0), self.max_lease_s)
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, scratch = tempfile.mkstemp(dir=directory, prefix=".")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump({"until": until}, out)
                os.replace(scratch, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
                raise
        except OSError as exc:
            log.warning("could not record a pause in flight in %s: %s", self.path, exc)

    def answered(self) -> None:
        """The engine answered the pause: nothing of it can land later."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the record of a pause in %s: %s", self.path, exc)

    def left_s(self) -> float:
        """Seconds a pause a predecessor sent may still land (0: none can)."""
        try:
            with open(self.path) as record:
                until = json.load(record)["until"]
        except FileNotFoundError:
            return 0.0
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not read the record of a pause in %s: %s", self.path, exc)
            return 0.0
        if not isinstance(until, (int, float)) or not math.isfinite(until):
            return 0.0
        # Never longer than a pause may land: a record from a clock set back
        # must not keep the engine "maybe paused" for longer.
        return min(max(until - time.time(), 0.0), self.longest_s)
