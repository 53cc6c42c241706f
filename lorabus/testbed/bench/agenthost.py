"""An agent host: many agents (or bare floor subscribers) in one process.

A thousand agents cannot each have a process on a 2-core machine, so a host
runs a share of the fleet: real :class:`agents.Agent` objects over
:class:`~lorabus.testbed.bench.engines.NullEngine` or the Dynamo driver against the
simulated fleet, each with its own NATS connection (as separate processes
would have), all on one shared connection, or one node agent
(:class:`agents.node.NodeAgent`) and its connection per node of the spec's
``nodes``, as node processes would have; null engines take the spec's load
latency, drawn per load. In ``floor`` role it instead holds one bare nats-py
subscription per worker that echoes each command as an ack: the bus floor's
fan-out side, laid out like the agents (one per node in the node layout,
echoing once for the node). With ``cache_dirs`` each agent keeps
adapters from the fleet's object store in its worker's directory there
(agents given one directory share a node's cache, as on one host).

Run as ``python -m lorabus.testbed.bench.agenthost <spec>`` (see ``control.py``);
answers ``times`` with what its engines went through since the last ask, and
``transitions`` with how many times each of its engines went from running to
paused since the last ask of that, ``peaks`` with the most adapters each null
engine held at once since the last ask of that, and ``stop_agent`` (with a
``worker``) by stopping that worker's agent as a kill would: its connection
closes, and nothing is said to the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.agents import Agent, CommandExecutor, DynamoDriver, EngineDriver
from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.node import NodeAgent
from lorabus.bus.connect import close, connect
from lorabus.bus.options import BusOptions
from lorabus.runtime.event_loop import serving_loop_factory, settle_collector
from lorabus.schemas import Subjects
from lorabus.security.signing import COORDINATOR_KEYS_ENV, CommandVerifier
from lorabus.testbed.bench.control import child_main, say, serve_requests
from lorabus.testbed.bench.engines import EngineTimes, NullEngine, TimedEngine

log = logging.getLogger(__name__)

_CONNECT_BATCH = 32


async def host(spec: dict[str, Any]) -> None:
    workers: dict[str, int] = spec["workers"]
    nodes: dict[str, list[str]] = spec.get("nodes") or {}
    subjects = Subjects(fleet=spec["fleet"])
    connections: list[NatsClient] = []
    tasks: list[asyncio.Task[None]] = []
    drivers: list[EngineDriver] = []
    nulls: dict[str, NullEngine] = {}
    times = EngineTimes()
    try:
        links = await _connections(spec, list(nodes or workers), connections)
        if spec["role"] == "floor":
            for sender, nc in zip(nodes or workers, links, strict=True):
                await _echo(nc, subjects, sender)
            for nc in connections:
                await nc.flush(timeout=10)
        else:
            await _start_agents(spec, workers, links, subjects, times, tasks, drivers, nulls)
        times.take()
        # The collector tuned as `lorabus agent` tunes its own, but once the
        # host's agents are up: a host's heap is that of a few hundred agents,
        # and with CPython's default thresholds each collection walked all of
        # them (about a sixth of a null-engine host's CPU), a cost that agents
        # in processes of their own, with small heaps, never pay.
        settle_collector()
        say({"ready": True, "workers": len(workers), "connections": len(connections)})

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] == "times":
                return times.take()
            if request["op"] == "transitions":
                return {"transitions": times.take_transitions()}
            if request["op"] == "peaks":
                return {"peaks": {wid: engine.take_peak() for wid, engine in nulls.items()}}
            if request["op"] == "stop_agent":
                if nodes:
                    raise ValueError("stop_agent stops one worker's agent: not in a node")
                index = list(workers).index(request["worker"])
                tasks[index].cancel()
                await asyncio.gather(tasks[index], return_exceptions=True)
                await close(links[index])
                return {"stopped": request["worker"]}
            raise ValueError(f"unknown request {request['op']!r}")

        await serve_requests(handle)
    finally:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Exception):
                log.error("an agent had died: %r", result)
        await asyncio.gather(*(close(nc) for nc in connections), return_exceptions=True)
        for driver in drivers:
            with contextlib.suppress(Exception):
                await driver.aclose()


async def _connections(
    spec: dict[str, Any], worker_ids: list[str], opened: list[NatsClient]
) -> list[NatsClient]:
    """One connection per worker, or one shared by all of them."""
    url = spec["nats_url"]
    identities = spec.get("identities") or {}

    def options(worker_id: str) -> BusOptions:
        """The worker's own identity in a secure run (paths only), else none."""
        return BusOptions.from_env(identities.get(worker_id, {}))

    if spec["shared_connection"]:
        opened.append(await connect(url, name=f"bench-host-{worker_ids[0]}"))
        return [opened[0]] * len(worker_ids)
    for start in range(0, len(worker_ids), _CONNECT_BATCH):
        batch = worker_ids[start : start + _CONNECT_BATCH]
        results = await asyncio.gather(
            *(connect(url, name=f"bench-{wid}", options=options(wid)) for wid in batch),
            return_exceptions=True,
        )
        opened.extend(nc for nc in results if isinstance(nc, NatsClient))
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return list(opened)


async def _echo(nc: NatsClient, subjects: Subjects, sender: str) -> None:
    ack_subject = subjects.ack(sender)

    async def on_command(msg: Msg) -> None:
        await nc.publish(ack_subject, msg.data)

    await nc.subscribe(subjects.cmd(), cb=on_command)


async def _start_agents(
    spec: dict[str, Any],
    workers: dict[str, int],
    links: list[NatsClient],
    subjects: Subjects,
    times: EngineTimes,
    tasks: list[asyncio.Task[None]],
    drivers: list[EngineDriver],
    nulls: dict[str, NullEngine],
) -> None:
    readies: list[asyncio.Event] = []
    rng = random.Random(spec["seed"])
    agents: dict[str, Agent] = {}
    for worker_id, world_size in workers.items():
        engine: EngineDriver
        if spec["engine"] == "null":
            engine = nulls[worker_id] = NullEngine(
                load_latency_s=spec["load_latency_s"], load_jitter_s=spec["load_jitter_s"], rng=rng
            )
        else:
            frontend_url = spec["sim_urls"][worker_id]  # its simulated fleet process's
            engine = DynamoDriver(f"{frontend_url}/workers/{worker_id}", frontend_url=frontend_url)
        driver = TimedEngine(engine, times, worker_id)
        drivers.append(driver)
        # Adapters from the fleet's object store go to the worker's node's cache,
        # made and checked as `lorabus agent` does at its start.
        cache_dir = (spec.get("cache_dirs") or {}).get(worker_id)
        cache = AdapterCache(cache_dir) if cache_dir else None
        if cache is not None:
            cache.check_writable()
        executor = CommandExecutor(
            worker_id,
            world_size,
            driver,
            adapter_cache=cache,
            max_adapters=spec.get("max_adapters", 0),
        )
        await executor.refresh()
        agents[worker_id] = Agent(subjects, executor, heartbeat_s=spec["heartbeat_s"])
    nodes: dict[str, list[str]] = spec.get("nodes") or {}
    identities = spec.get("identities") or {}
    runs: list[tuple[str, Agent | NodeAgent]] = (
        [(node, NodeAgent(node, [agents[w] for w in ids])) for node, ids in nodes.items()]
        if nodes
        else list(agents.items())
    )
    for (name, runner), nc in zip(runs, links, strict=True):
        # In a secure run, each agent obeys only commands signed with the
        # coordinator key its identity (or its node's) pins, as a deployed one does.
        keys = identities.get(name, {}).get(COORDINATOR_KEYS_ENV, "").split()
        for agent in runner.agents if isinstance(runner, NodeAgent) else [runner]:
            agent.verifier = CommandVerifier(keys)
        ready = asyncio.Event()
        readies.append(ready)
        tasks.append(asyncio.create_task(runner.run(nc, ready), name=f"agent-{name}"))
    deadline = time.monotonic() + spec.get("ready_timeout_s", 60.0)
    waiting = asyncio.ensure_future(asyncio.gather(*(ready.wait() for ready in readies)))
    try:
        while not waiting.done():
            dead = [task for task in tasks if task.done()]
            if dead:
                dead[0].result()  # raises what killed it
                raise RuntimeError(f"{dead[0].get_name()} stopped at start")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{sum(not r.is_set() for r in readies)} agents not ready in time"
                )
            await asyncio.wait({waiting}, timeout=0.1)
    finally:
        waiting.cancel()


if __name__ == "__main__":
    # On the event loop of `lorabus agent`: hosted agents stand in for it.
    child_main(host, loop_factory=serving_loop_factory())
