"""The rank map joined as a torch process group: real processes, gloo on CPU.

One run of eight processes serves most tests (torch processes start slowly):
a trainer and the ranks of workers ``a``, ``b``, ``c`` with world sizes 2, 4
and 1 join with the published offsets and receive the trainer's LoRA tensors;
then the membership changes (``b`` restarts with world size 2), the trainer
and the new ranks join the new group, and ``b``'s two ranks that still hold
the old map are refused. Each process reports what it saw as JSON lines; the
tests compare those reports with what the map and the tensors say.

Run as a script, this file imports torch once and forks those processes
(``_launch``, ``_member``); the test kills the script's whole process group
when it ends, so none outlives it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the rank group needs the torch extra: lorabus[torch]")

from lorabus.errors import BadRequest  # noqa: E402
from lorabus.rank_group import StaleMembership, global_rank, join_rank_group  # noqa: E402
from lorabus.schemas import UpdateResult  # noqa: E402
from lorabus.schemas.rankmap import build_rank_map  # noqa: E402
from lorabus.testbed.natsserver import free_port  # noqa: E402

OLD = {"a": 2, "b": 4, "c": 1}
#: ``b`` restarted with tensor parallelism 2: a new membership, a new version.
NEW = {"a": 2, "b": 2, "c": 1}
#: (worker id, local rank) of every inference process; None is the trainer.
ROLES: list[tuple[str | None, int]] = [
    (None, 0),
    *((worker, local) for worker, size in sorted(OLD.items()) for local in range(size)),
]
#: The rendezvous and every collective; only there to fail instead of hang.
JOIN_TIMEOUT_S = 30.0
RUN_DEADLINE_S = 90.0


def _lora_tensors(seed: int) -> dict[str, Any]:
    """LoRA A/B matrices as a trainer holds them: several shapes and dtypes,
    one of them a transposed (non-contiguous) view, one a scalar."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        rank, hidden = 4 * (layer + 1), 48 + 16 * layer
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator).to(
            dtype
        )
        tensors[f"{prefix}.lora_B.weight"] = (
            torch.randn(rank, hidden * 2, generator=generator).to(dtype).t()
        )
    tensors["lora_scale"] = torch.tensor(2.0, dtype=torch.float64)
    return tensors


def _describe(tensors: dict[str, Any]) -> dict[str, list[Any]]:
    """Name -> [dtype, shape, sha256 of the bytes in logical order]."""
    return {
        name: [
            str(t.dtype),
            list(t.shape),
            hashlib.sha256(
                t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest(),
        ]
        for name, t in tensors.items()
    }


def _member(spec: dict[str, Any], *, prefix: str) -> None:
    """One process: join each phase's group with the map it holds, report, leave."""
    worker_id, local_rank = spec["worker_id"], spec["local_rank"]
    for index, phase in enumerate(spec["phases"]):
        holds = build_rank_map(phase["holds"])
        report: dict[str, Any] = {"phase": index}
        started = time.monotonic()
        try:
            group = join_rank_group(
                holds,
                f"tcp://127.0.0.1:{phase['port']}",
                expected_membership_version=holds.membership_version,
                worker_id=worker_id,
                local_rank=local_rank,
                backend="gloo",
                timeout_s=JOIN_TIMEOUT_S,
            )
        except StaleMembership as exc:
            report.update(refused=str(exc), seconds=time.monotonic() - started)
        else:
            with group:
                sent = _lora_tensors(phase["seed"]) if group.rank == 0 else None
                received = group.broadcast(sent)
                report.update(
                    rank=group.rank,
                    world_size=group.world_size,
                    membership_version=group.membership_version,
                    tensors=_describe(received),
                )
        # One write(2) per line, under the pipe's atomic size: members share
        # stdout (print may write the text and its newline apart, as it does
        # when PYTHONUNBUFFERED is set, and another member's line gets between).
        line = f"{prefix} {json.dumps(report)}\n".encode()
        assert len(line) <= select.PIPE_BUF, len(line)
        os.write(sys.stdout.fileno(), line)


def _launch(specs: dict[str, dict[str, Any]], logs: Path) -> None:
    """Fork one process per spec from this one, which has imported torch once
    (eight fresh interpreters would each spend seconds importing it); each writes
    its reports as ``<name> <json>`` lines and its stderr to ``<logs>/<name>.log``."""
    children = {}
    for name, spec in specs.items():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(logs / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 2)
                _member(spec, prefix=name)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                # _exit: the parent's atexit handlers and buffers are not this child's.
                os._exit(code)
        children[pid] = name
    failed = [children[pid] for pid in children if os.waitpid(pid, 0)[1] != 0]
    sys.exit(f"failed: {failed}" if failed else 0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str | None, int], list[Any]]:
    """Run the eight processes through both phases; return each one's reports."""
    logs = tmp_path_factory.mktemp("rank-group")
    ports = free_port(), free_port()
    specs: dict[str, dict[str, Any]] = {}
    for worker, local in ROLES:
        in_new = worker is None or local < NEW[worker]
        phases = [
            {"holds": OLD, "port": ports[0], "seed": 1},
            # b's ranks 2 and 3 are gone from the new membership but still hold the old map.
            {"holds": NEW if in_new else OLD, "port": ports[1], "seed": 2},
        ]
        specs[f"{worker or 'trainer'}-{local}"] = {
            "worker_id": worker,
            "local_rank": local,
            "phases": phases,
        }
    # Its own session, so that killing its process group stops every forked member too.
    launcher = subprocess.Popen(
        [sys.executable, __file__, str(logs), json.dumps(specs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = launcher.communicate(timeout=RUN_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the members did not finish in {RUN_DEADLINE_S} s; their logs: {logs}")
    finally:
        # A launcher that exited 0 has reaped every member; otherwise stop them all.
        if launcher.poll() != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert launcher.returncode == 0, (err, sorted(logs.iterdir()))
    reports: dict[tuple[str | None, int], list[Any]] = {role: [] for role in ROLES}
    for line in out.splitlines():
        name, _, report = line.partition(" ")
        spec = specs[name]
        reports[(spec["worker_id"], spec["local_rank"])].append(json.loads(report))
    assert {role: len(r) for role, r in reports.items()} == dict.fromkeys(ROLES, 2), out
    return reports


def _expected_rank(rank_map: dict[str, int], worker: str | None, local: int) -> int:
    if worker is None:
        return 0
    return 1 + sum(size for w, size in sorted(rank_map.items()) if w < worker) + local


def test_every_process_joins_the_group_at_its_published_offset(run: dict[Any, Any]) -> None:
    old = build_rank_map(OLD)
    assert [(e.worker_id, e.rank_offset) for e in old.entries] == [("a", 1), ("b", 3), ("c", 7)]
    ranks = {role: reports[0]["rank"] for role, reports in run.items()}
    assert ranks == {(w, local): _expected_rank(OLD, w, local) for w, local in ROLES}
    assert sorted(ranks.values()) == list(range(old.world_size)) == list(range(8))
    assert {r[0]["world_size"] for r in run.values()} == {8}
    assert {r[0]["membership_version"] for r in run.values()} == {old.membership_version}


def test_every_rank_receives_the_trainers_lora_tensors_bit_exact(run: dict[Any, Any]) -> None:
    sent = _describe(_lora_tensors(1))
    assert {"torch.bfloat16", "torch.float16", "torch.float32"} <= {d for d, _, _ in sent.values()}
    for role, reports in run.items():
        assert reports[0]["tensors"] == sent, role


def test_a_changed_membership_gets_a_new_version_and_the_new_group_forms(
    run: dict[Any, Any],
) -> None:
    new = build_rank_map(NEW)
    assert new.membership_version != build_rank_map(OLD).membership_version
    members = {role: reports[1] for role, reports in run.items() if "rank" in reports[1]}
    assert {role: r["rank"] for role, r in members.items()} == {
        (w, local): _expected_rank(NEW, w, local)
        for w, local in ROLES
        if w is None or local < NEW[w]
    }
    assert sorted(r["rank"] for r in members.values()) == list(range(new.world_size))
    sent = _describe(_lora_tensors(2))
    for role, report in members.items():
        assert report["membership_version"] == new.membership_version, role
        assert report["tensors"] == sent, role


def test_a_rank_holding_the_old_map_is_refused_before_joining(run: dict[Any, Any]) -> None:
    old, new = build_rank_map(OLD), build_rank_map(NEW)
    refused = {role: reports[1] for role, reports in run.items() if "refused" in reports[1]}
    assert sorted(refused) == [("b", 2), ("b", 3)]
    for report in refused.values():
        assert old.membership_version in report["refused"]
        assert new.membership_version in report["refused"]
        # Refused as soon as the trainer published the new version, not at the timeout.
        assert report["seconds"] < JOIN_TIMEOUT_S / 2


# What is refused without any process group: checked before torch is touched.


@pytest.fixture
def rank_map() -> Iterator[Any]:
    yield build_rank_map(OLD)
    assert not torch.distributed.is_initialized()


def test_a_map_of_another_membership_than_the_expected_one_is_refused(rank_map: Any) -> None:
    with pytest.raises(StaleMembership, match=build_rank_map(NEW).membership_version):
        join_rank_group(
            rank_map,
            "tcp://127.0.0.1:1",
            expected_membership_version=build_rank_map(NEW).membership_version,
            worker_id="a",
        )


@pytest.mark.parametrize(
    ("worker_id", "local_rank", "why"),
    [("d", 0, "not in the rank map"), ("b", 4, "not in 0..3"), ("c", -1, "not in 0..0")],
)
def test_a_worker_outside_the_map_or_a_local_rank_out_of_range_is_refused(
    rank_map: Any, worker_id: str, local_rank: int, why: str
) -> None:
    with pytest.raises(BadRequest, match=why):
        join_rank_group(
            rank_map,
            "tcp://127.0.0.1:1",
            expected_membership_version=rank_map.membership_version,
            worker_id=worker_id,
            local_rank=local_rank,
        )


def test_a_failed_update_has_no_group_to_join(rank_map: Any) -> None:
    failed = UpdateResult(update_id="u1", status="failed", adapter="policy", version=3)
    with pytest.raises(BadRequest, match="no rank map"):
        join_rank_group(failed, "tcp://127.0.0.1:1", expected_membership_version="x")


def test_global_ranks_follow_the_offsets() -> None:
    rank_map = build_rank_map(OLD)
    assert global_rank(rank_map) == 0
    assert [global_rank(rank_map, "b", i) for i in range(4)] == [3, 4, 5, 6]
    assert global_rank(rank_map, "c") == 7


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_importing_lorabus_and_its_rank_group_module_never_imports_torch() -> None:
    done = _python(
        "import sys, lorabus, lorabus.rank_group; print('torch' in sys.modules)",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_without_torch_joining_says_which_extra_to_install() -> None:
    # None in sys.modules makes ``import torch`` fail as if it were not installed.
    done = _python(
        "import sys; sys.modules['torch'] = None\n"
        "from lorabus.schemas.rankmap import build_rank_map\n"
        "from lorabus.rank_group import TorchMissing, join_rank_group\n"
        "m = build_rank_map({'a': 1})\n"
        "try:\n"
        "    join_rank_group(m, 'tcp://127.0.0.1:1', expected_membership_version="
        "m.membership_version)\n"
        "except TorchMissing as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'lorabus[torch]'" in done.stdout


if __name__ == "__main__":
    _launch(json.loads(sys.argv[2]), Path(sys.argv[1]))
