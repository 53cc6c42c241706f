"""The simulated Dynamo fleet of a benchmark, in a process of its own.

Both the agents and the direct-HTTP baseline drive the same fleet: workers'
system servers under ``/workers/<id>`` and the frontend at the root, over
real HTTP. Before each update the bench asks for ``jitter``: every worker
draws its next load latency from ``load_latency_s +- load_jitter_s`` (the
engine-side load time, one draw per worker and update), the answer names the
slowest draw, and the workers' request logs are cleared so that a long run
does not grow the fleet's memory.

Run as ``python -m lorabus.testbed.bench.simhost <spec>`` (see ``control.py``).
"""

from __future__ import annotations

import random
from typing import Any

from lorabus.simfleet import SimFleet
from lorabus.testbed.bench.control import child_main, say, serve_requests


async def host(spec: dict[str, Any]) -> None:
    fleet = SimFleet(list(spec["workers"]), list(spec["workers"].values()))
    rng = random.Random(spec.get("seed", 1))
    latency, jitter = spec["load_latency_s"], spec["load_jitter_s"]
    await fleet.start()
    try:
        say(
            {
                "ready": True,
                "url": fleet.url,
                "workers": {w.worker_id: w.world_size for w in fleet.workers.values()},
            }
        )

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] != "jitter":
                raise ValueError(f"unknown request {request['op']!r}")
            slowest = 0.0
            for worker in fleet.workers.values():
                worker.requests.clear()
                if latency > 0:
                    drawn = max(0.0, latency + rng.uniform(-jitter, jitter))
                    worker.set_faults(latency_s={"load": drawn})
                    slowest = max(slowest, drawn)
            return {"slowest_load_s": slowest}

        await serve_requests(handle)
    finally:
        await fleet.stop()


if __name__ == "__main__":
    child_main(host)
