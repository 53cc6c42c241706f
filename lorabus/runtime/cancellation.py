"""Noticing a cancellation that Python 3.11 lost.

``asyncio.wait_for`` in Python 3.11 can return normally although its task was
cancelled meanwhile (fixed in 3.12), and nats-py awaits through ``wait_for``
everywhere. The cancellation is still counted on the task, so a long-lived
loop that checks at each turn stops as it should.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
