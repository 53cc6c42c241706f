"""An RL orchestrator's weight sync with lorabus, in place of direct HTTP.

Without lorabus (prime-rl's Dynamo path), every trainer step the
orchestrator itself:

1. pauses every engine (``POST /engine/pause_generation`` per worker),
2. loads the new adapter on each worker (``POST /v1/loras``),
3. polls the frontend's ``/v1/models`` until the adapter shows up,
4. resumes every engine in a ``finally``, and
5. derives NCCL rank offsets as ``inference_world_size // len(workers)``.

If the orchestrator dies between 1 and 4 the fleet stays paused; one
replica's failed load is hidden behind "the frontend lists it"; offsets are
wrong as soon as workers have different tensor-parallel sizes.

With lorabus all of that is one request: the coordinator pauses under a
lease, loads and reads back on every member, checks the frontend, resumes,
and answers with the served name to sample from and the rank map built from
each worker's real world size. :class:`PolicyPublisher` is what an
orchestrator keeps per run; an asynchronous one, whose rollouts may sample
from a policy up to K steps old, gives ``max_staleness=K`` and every engine
keeps serving the K + 1 newest steps.
"""

from __future__ import annotations

import httpx

from lorabus import LorabusError, RankMap, UpdateClient


class PolicyPublisher:
    """Publishes each trainer step's adapter to the fleet, and says what to
    sample from and when the weight-broadcast group must be rebuilt."""

    def __init__(
        self,
        client: UpdateClient,
        *,
        adapter: str,
        run_id: str,
        max_staleness: int | None = None,
    ) -> None:
        self.client = client
        self.adapter = adapter
        self.run_id = run_id
        self.keep = None if max_staleness is None else max_staleness + 1
        """How many steps every engine serves (None: the coordinator's ``--keep``)."""
        self.served_name: str | None = None
        """What rollout requests name as their model once a step is published."""
        self.rank_map: RankMap | None = None
        self._membership: str | None = None
        self._step: int | None = None

    async def publish(self, step: int, path: str, *, digest: str | None = None) -> bool:
        """Serve ``path`` as this run's policy at ``step``; return True when the
        weight-broadcast group must be rebuilt (the fleet's membership changed).

        The update id is derived from the run and step, so an orchestrator that
        restarts and publishes the same step again gets the first outcome
        instead of a second update. A failed update raises its error, and the
        fleet keeps serving the previous step, unpaused."""
        if self._step is not None and step < self._step:
            # Its id would fetch that step's old outcome, not serve it again.
            raise ValueError(f"step {step} is older than the published step {self._step}")
        result = await self.client.update(
            self.adapter,
            path,
            version=step,
            update_id=f"{self.run_id}-step-{step}",
            digest=digest,
            keep=self.keep,
        )
        if not result.committed:
            assert result.error is not None
            raise LorabusError.from_info(result.error)
        assert result.rank_map is not None
        self.served_name = result.adapter
        self._step = step
        self.rank_map = result.rank_map
        rebuild = result.rank_map.membership_version != self._membership
        self._membership = result.rank_map.membership_version
        return rebuild

    def broadcast_ranks(self) -> dict[str, range]:
        """Each worker's ranks in the weight-broadcast group (the trainer is rank
        0): its rank offset up to its own world size, whatever the others'."""
        assert self.rank_map is not None, "publish a step first"
        return {
            entry.worker_id: range(entry.rank_offset, entry.rank_offset + entry.world_size)
            for entry in self.rank_map.entries
        }

    async def rollout(self, frontend_url: str, prompt: str, *, timeout_s: float = 30.0) -> str:
        """One rollout request against the policy just published."""
        assert self.served_name is not None, "publish a step first"
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.post(
                f"{frontend_url}/v1/chat/completions",
                json={"model": self.served_name, "messages": [{"role": "user", "content": prompt}]},
            )
            response.raise_for_status()
            return str(response.json()["choices"][0]["message"]["content"])
