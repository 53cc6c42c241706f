"""The orchestrator's client reports an absent coordinator instead of hanging."""

from __future__ import annotations

import pytest

from lorabus.bus import close, connect
from lorabus.client import UpdateClient
from lorabus.errors import NoCoordinator


async def test_no_coordinator_is_a_failed_result_with_its_own_code(
    nats_url: str, fleet_name: str
) -> None:
    nc = await connect(nats_url, name="test-client")
    try:
        client = UpdateClient(nc, fleet_name, no_coordinator_wait_s=0.3)
        result = await client.update("policy", "/a/step_1", version=1, update_id="lonely")
        with pytest.raises(NoCoordinator, match=fleet_name):
            await client.status()
    finally:
        await close(nc)

    assert result.status == "failed" and result.update_id == "lonely"
    assert result.error is not None and result.error.code == "no_coordinator"
    assert fleet_name in result.error.message
