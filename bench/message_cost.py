"""What one message costs a bare nats-py subscriber, by how messages arrive.

A private nats-server; a subscriber process (uvloop, a no-op callback, as
``lorabus coordinator`` runs) on ``x.>``; a publisher process that sends the
same ack-sized message COUNT times, either all at once or one every GAP
seconds. The subscriber prints the CPU seconds (user and system) it spent
from its first message to its last, per message:

    .venv/bin/python bench/message_cost.py            # 3000 messages, 0 and 1 ms apart
    .venv/bin/python bench/message_cost.py --count 5000 --gaps 0,0.0002,0.001

A coordinator with HTTP engines gets its acks spread over the update, as
engines answer; what each costs it then is this subscriber's spaced figure,
not its batched one (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys

import nats
import uvloop

from lorabus.testbed.natsserver import NatsServer

ACK = (
    b'{"type":"ack","v":4,"update_id":"step-1","phase":"load","worker_id":"w0001",'
    b'"ok":true,"world_size":1,"adapters":["policy-v1","policy-v2"],"paused":true}'
)
_DEADLINE_S = 120.0


async def _subscribe(url: str, count: int) -> None:
    nc = await nats.connect(url)
    got = 0
    first: resource.struct_rusage | None = None
    done = asyncio.Event()

    async def on_message(_msg: object) -> None:
        nonlocal got, first
        if first is None:
            first = resource.getrusage(resource.RUSAGE_SELF)
        got += 1
        if got == count:
            done.set()

    await nc.subscribe("x.>", cb=on_message)
    await nc.flush()
    print("ready", flush=True)
    try:
        await asyncio.wait_for(done.wait(), _DEADLINE_S)
    finally:
        await nc.close()
    last = resource.getrusage(resource.RUSAGE_SELF)
    assert first is not None
    user = (last.ru_utime - first.ru_utime) / count * 1e6
    system = (last.ru_stime - first.ru_stime) / count * 1e6
    print(f"{user:.1f} {system:.1f}", flush=True)


async def _publish(url: str, count: int, gap_s: float) -> None:
    nc = await nats.connect(url)
    try:
        for i in range(count):
            await nc.publish(f"x.w{i % 1024:04d}", ACK)
            if gap_s:
                await nc.flush()
                await asyncio.sleep(gap_s)
        await nc.flush()
    finally:
        await nc.close()


def _measure(url: str, count: int, gap_s: float) -> tuple[float, float]:
    me = [sys.executable, __file__, "--url", url, "--count", str(count)]
    with subprocess.Popen([*me, "--role", "subscribe"], stdout=subprocess.PIPE, text=True) as sub:
        try:
            assert sub.stdout is not None
            if sub.stdout.readline().strip() != "ready":
                raise RuntimeError("the subscriber did not start")
            subprocess.run([*me, "--role", "publish", "--gap", str(gap_s)], check=True, timeout=300)
            user, system = sub.stdout.readline().split()
            sub.wait(timeout=_DEADLINE_S)
        finally:
            if sub.poll() is None:
                sub.kill()
    return float(user), float(system)


async def _main(count: int, gaps: list[float]) -> None:
    async with NatsServer() as server:
        print(f"{'gap ms':>7} {'user us/msg':>12} {'system us/msg':>14}")
        for gap_s in gaps:
            user, system = await asyncio.to_thread(_measure, server.url, count, gap_s)
            print(f"{gap_s * 1000:7.2f} {user:12.1f} {system:14.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument(
        "--gaps", default="0,0.001", help="seconds between messages, comma-separated"
    )
    parser.add_argument("--role", choices=["subscribe", "publish"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--gap", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "subscribe":
        uvloop.run(_subscribe(args.url, args.count))
    elif args.role == "publish":
        uvloop.run(_publish(args.url, args.count, args.gap))
    else:
        uvloop.run(_main(args.count, [float(g) for g in args.gaps.split(",")]))


if __name__ == "__main__":
    main()
