"""The fleet's object store of adapters, as the leader sees it: whether the
object a request names is there, before anything of the update runs.

Only the orchestrator role writes it (``lorabus adapter push``) and agents
read it (:mod:`lorabus.adapter_objects`); the leader looks, so that an
update naming a digest nobody pushed is refused at once, with nothing
paused and no member asked to fetch it.
"""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

from lorabus.adapter_objects import object_size
from lorabus.errors import BadRequest, BusError
from lorabus.schemas import Subjects

_LOOK_TIMEOUT_S = 5.0


class AdapterStore:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects

    async def check_stored(self, digest: str) -> None:
        """Raise BadRequest unless the store holds an object under ``digest``."""
        try:
            size = await object_size(self._nc, self._subjects, digest, timeout_s=_LOOK_TIMEOUT_S)
        except (TimeoutError, BusError) as exc:
            raise BadRequest(
                f"could not look for adapter {digest} in the fleet's object store: {exc}"
            ) from exc
        if size is None:
            raise BadRequest(
                f"adapter {digest} is not in the fleet's object store: push it first "
                "(lorabus adapter push DIR)"
            )
