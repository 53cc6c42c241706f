"""A full adapter store starves nothing: it has a limit of its own, inside the
fleet account's JetStream budget that ``lorabus auth init`` writes, so an
orchestrator that pushes without asking for updates fills the store and no
more. A push into it fails saying so; the leader keeps its lease, and an
update of an adapter already stored writes its in-flight record, commit
point and result, and commits.

A real nats-server from ``lorabus auth init``'s configuration, every part as
its own identity.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from lorabus.errors import BusError
from lorabus.schemas import Subjects
from lorabus.security.auth_init import SERVER_CONF, default_jetstream_bytes, write_fleet_auth
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter

STORE_MAX_BYTES = 2 << 20


async def test_a_full_store_refuses_pushes_and_the_fleet_goes_on(
    fleet_name: str, tmp_path: Path
) -> None:
    async with EmbeddedStack(
        [1, 1],
        fleet=fleet_name,
        secure=True,
        heartbeat_s=0.2,
        adapter_store_max_bytes=STORE_MAX_BYTES,
    ) as stack:
        assert stack.client is not None and stack.coordinator is not None
        epoch = stack.coordinator.epoch
        kept = await stack.client.push_adapter(str(write_adapter(tmp_path, 1, hidden=1024)))
        refused = None
        for step in range(2, 12):  # about 0.5 MB each: the store is full within five
            try:
                await stack.client.push_adapter(str(write_adapter(tmp_path, step, hidden=1024)))
            except BusError as exc:
                refused = exc
                break
        result = await stack.client.update("policy", digest=kept, version=1, timeout_s=30)
        status = await stack.client.status()

    assert refused is not None, "the store took more than its limit"
    assert "is full" in str(refused) and "lorabus adapter list" in str(refused)
    assert result.committed and result.digest == kept, result.error
    assert status.leader and status.epoch == epoch, "the leader kept its lease"


@pytest.mark.parametrize("method", ["nkey", "jwt"])
def test_auth_init_gives_the_fleet_account_a_jetstream_budget(method: str, tmp_path: Path) -> None:
    """Per replica (JetStream counts each), on a cluster times its nodes."""
    alone = write_fleet_auth(tmp_path / "alone", Subjects(fleet="f"), ["w000"], method=method)
    nodes = ["n1", "n2", "n3"]
    cluster = write_fleet_auth(
        tmp_path / "cluster", Subjects(fleet="f"), ["w000"], tls=True, cluster_nodes=nodes
    )
    text = (alone.directory / SERVER_CONF).read_text()

    assert default_jetstream_bytes(nodes) == 3 * default_jetstream_bytes()
    if method == "nkey":
        assert f"max_file: {default_jetstream_bytes()}" in text
    else:  # the fleet account's JWT, among those the configuration preloads
        budgets = [c["nats"].get("limits", {}).get("disk_storage") for c in _claims(text)]
        assert default_jetstream_bytes() in budgets, budgets
    assert (
        f"max_file: {default_jetstream_bytes(nodes)}"
        in (cluster.directory / SERVER_CONF).read_text()
    )
    with pytest.raises(ValueError, match="at least"):
        write_fleet_auth(tmp_path / "tiny", Subjects(fleet="f"), ["w000"], jetstream_max_bytes=1)


def _claims(conf: str) -> list[dict[str, Any]]:
    """The claims of every JWT a server configuration holds (unverified)."""
    claims = []
    for token in re.findall(r"eyJ[\w-]+\.([\w-]+)\.[\w-]+", conf):
        claims.append(json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))))
    return claims
