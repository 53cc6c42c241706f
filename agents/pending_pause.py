"""A pause sent to the engine and not answered yet, recorded on the node's disk.

An agent killed while its engine's pause call is in flight leaves a request
the engine may still carry out, up to the engine's call timeout later: after
its successor started and resumed the engine, so that the engine ends up
paused with nobody holding it. The successor cannot see that request, so the
agent writes it down before sending it: ``.pauses/<fleet>.<worker>.json`` in
the node's adapter cache directory holds the wall-clock time until which the
pause may still land::

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

log = logging.getLogger(__name__)


class PendingPause:
    """The record of one worker's pause in flight, at ``path``."""

    def __init__(self, path: str, late_s: float) -> None:
        """``late_s``: how long after it was sent a pause may still land (the
        engine's call timeout)."""
        self.path = path
        self.late_s = late_s

    @classmethod
    def in_cache(cls, cache_dir: str, holder: str, late_s: float) -> PendingPause:
        return cls(os.path.join(cache_dir, ".pauses", f"{holder}.json"), late_s)

    def sent(self) -> None:
        """A pause is about to be sent: it may land until ``late_s`` from now."""
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, scratch = tempfile.mkstemp(dir=directory, prefix=".")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump({"until": time.time() + self.late_s}, out)
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
        # Never longer than one call timeout: a record from a clock set back
        # must not keep the engine "maybe paused" for longer.
        return min(max(until - time.time(), 0.0), self.late_s)
