"""A command stopped by a signal leaves, even when something outlives its
clean-up: a supervisor that sent SIGTERM must not wait for ever."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from lorabus.cli.common import EXIT_GRACE_S, EXIT_INTERRUPTED

DEADLINE_S = 30.0

_STUBBORN = textwrap.dedent(
    """
    import asyncio, logging, sys
    from lorabus.cli.common import run

    logging.basicConfig(level=logging.INFO)
    kept = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # outlives every cancellation, as a stuck task would

    async def main():
        kept.append(asyncio.get_running_loop().create_task(stubborn()))
        print("ready", flush=True)
        await asyncio.sleep(3600)
        return 0

    sys.exit(run(main))
    """
)


def test_a_stopped_command_leaves_even_when_a_task_outlives_its_cancellation() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=DEADLINE_S)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=DEADLINE_S)
    assert child.stderr is not None
    logged = child.stderr.read()

    assert code == EXIT_INTERRUPTED, logged
    assert "stopped by signal" in logged
    assert f"still here {EXIT_GRACE_S:.0f} s after being stopped: leaving anyway" in logged
