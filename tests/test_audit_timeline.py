"""``lorabus audit timeline`` as an operator runs it: a trail tapped from a
real fleet (one update committed, one failed on a worker) drawn as one page
with a row per worker; bad input said plainly; what the trail holds is
escaped, and a fleet of 1,024 workers still gets a row each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import msgspec
from processes import run_lorabus

from lorabus.audit.timeline import build_timelines
from lorabus.audit.timeline_page import render_page
from lorabus.audit.verify import TrailRecord
from lorabus.testbed.stack import EmbeddedStack

WORKERS = {"w000": 1, "w001": 2, "w002": 1}


@dataclass
class _Row:
    classes: list[str]
    text: str = ""
    bars: list[str] = field(default_factory=list)


class _Page(HTMLParser):
    """Each update section's worker rows, with their classes and text."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict[str, _Row]] = {}
        self.external: list[str] = []
        self._section = ""
        self._row: _Row | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("script", "link", "img", "iframe") or "src" in found or "href" in found:
            self.external.append(f"<{tag} {found}>")
        classes = (found.get("class") or "").split()
        if tag == "section":
            self._section = (found.get("id") or "").removeprefix("update-")
            self.sections[self._section] = {}
        if "row" in classes and "worker" in classes:
            self._row = _Row(classes)
            self.sections[self._section][found.get("data-worker") or ""] = self._row
            self._depth = 0
        if self._row is not None:
            self._depth += tag == "div"
            if "bar" in classes:
                self._row.bars += [c for c in classes if c != "bar"]

    def handle_endtag(self, tag: str) -> None:
        if self._row is not None and tag == "div":
            self._depth -= 1
            if self._depth == 0:
                self._row = None

    def handle_data(self, data: str) -> None:
        if self._row is not None:
            self._row.text += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    assert not any(marker in page for marker in ("url(", "@import", "http-equiv")), (
        "the page must need nothing from a network"
    )
    return parser


async def test_a_trail_becomes_a_page_with_a_row_per_worker_and_the_failed_one_marked(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
    fleet_name: str,
    tmp_path: Path,
) -> None:
    trail, page_path = tmp_path / "trail.jsonl", tmp_path / "timeline.html"
    async with make_stack(list(WORKERS.values())) as stack:
        assert stack.client is not None and stack.sim is not None
        committed = await stack.client.update("policy", make_adapter(1), version=1)
        stack.sim.workers["w001"].set_faults(fail_next_loads=1, load_failure_status=400)
        failed = await stack.client.update("policy", make_adapter(2), version=2)
        common = ["--nats", nats_url, "--fleet", fleet_name]
        tapped = await run_lorabus("tap", *common, "--no-follow", "--out", str(trail))
        live = await run_lorabus(
            "audit", "timeline", "--live", *common, "--out", str(tmp_path / "live.html")
        )
        live_first = await run_lorabus(
            "audit", "timeline", "--live", *common, "--update", committed.update_id,
            "--out", str(tmp_path / "live-first.html"),
        )  # fmt: skip
        live_unknown = await run_lorabus(
            "audit", "timeline", "--live", *common, "--update", "nope",
            "--out", str(tmp_path / "nope.html"),
        )  # fmt: skip
    drawn = await run_lorabus(
        "audit", "timeline", str(trail), "--last", "2", "--out", str(page_path)
    )

    assert committed.committed and not failed.committed, (committed, failed)
    assert tapped.returncode == 0, tapped
    assert drawn.returncode == 0 and "2 update(s) drawn" in drawn.stdout, drawn
    assert live.returncode == 0, live
    assert set(_parse((tmp_path / "live.html").read_text()).sections) == {failed.update_id}
    assert live_first.returncode == 0 and "1 update(s) drawn" in live_first.stdout, live_first
    first_rows = _parse((tmp_path / "live-first.html").read_text()).sections
    assert set(first_rows) == {committed.update_id}
    assert set(first_rows[committed.update_id]) == set(WORKERS), first_rows
    assert live_unknown.returncode == 1 and "no update nope" in live_unknown.stderr, live_unknown
    assert f"2 update(s); the latest: {committed.update_id}, {failed.update_id}" in (
        live_unknown.stderr
    )
    page = _parse(page_path.read_text())
    assert page.external == []
    ok_rows, failed_rows = page.sections[committed.update_id], page.sections[failed.update_id]
    assert set(ok_rows) == set(failed_rows) == set(WORKERS), page.sections
    for worker in WORKERS:
        drawn_phases = {"phase-pause", "phase-load", "phase-resume", "phase-canary"}
        assert drawn_phases <= set(ok_rows[worker].bars), ok_rows
        assert "failed" not in ok_rows[worker].classes
    for rows in (ok_rows, failed_rows):
        for worker, row in rows.items():
            phases = [c for c in row.bars if c.startswith("phase-")]
            assert len(phases) == len(set(phases)), f"one bar per phase: {worker} {row}"
            assert "unresumed" not in row.classes, f"every engine was resumed: {worker} {row}"
    marked = [w for w, row in failed_rows.items() if "failed" in row.classes]
    assert marked == ["w001"], failed_rows
    assert "injected load failure" in failed_rows["w001"].text
    assert "not-ok" in failed_rows["w001"].bars
    whole = page_path.read_text()
    assert "slowest" in whole and f"update {failed.update_id}" in whole


async def test_an_unknown_update_or_an_empty_trail_is_said_plainly_and_poison_is_left_out(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    good = _record(1, "ack", _ack("u1", "w000", "load", ok=True))
    poison = TrailRecord(
        seq=2, subject="lorabus.t.ack.w000", ts=2.0, kind="ack", message={}, poison="not an ack"
    )
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([_line(good), "this is no record", _line(poison)]) + "\n")
    out = tmp_path / "page.html"

    unknown = await run_lorabus(
        "audit", "timeline", str(mixed), "--update", "nope", "--out", str(out)
    )
    nothing = await run_lorabus("audit", "timeline", str(empty), "--out", str(out))
    assert not out.exists()
    partial = await run_lorabus("audit", "timeline", str(mixed), "--out", str(out))

    for finished in (unknown, nothing, partial):
        assert "Traceback" not in finished.stderr, finished
    assert unknown.returncode == 1 and "no update nope" in unknown.stderr and "u1" in unknown.stderr
    assert nothing.returncode == 1 and "holds no update" in nothing.stderr, nothing
    assert partial.returncode == 0, partial
    assert "1 line(s)" in partial.stderr and "1 poison record(s)" in partial.stderr, partial
    assert set(_parse(out.read_text()).sections["u1"]) == {"w000"}


def test_what_the_trail_says_is_escaped_and_a_thousand_workers_each_get_a_row() -> None:
    hostile = "<img src=x onerror=alert(1)>"
    records = [
        _record(
            1,
            "event",
            {
                "type": "update_started",
                "update_id": "u1",
                "adapter": "policy",
                "version": 3,
                "members": {f"w{i:04d}": 1 for i in range(1024)},
            },
        )
    ]
    for i in range(1024):
        took = 5.0 if i == 700 else 0.1
        ok = i != 3
        records.append(
            _record(2 + i, "ack", _ack("u1", f"w{i:04d}", "load", ok=ok, took=took, error=hostile))
        )

    (timeline,) = build_timelines(records)
    page = render_page([timeline], order="slowest")
    parsed = _parse(page)

    assert hostile not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert parsed.external == []
    rows = parsed.sections["u1"]
    assert len(rows) == 1024
    assert next(iter(rows)) == "w0700", "the slowest worker comes first"
    assert [w for w, row in rows.items() if "failed" in row.classes] == ["w0003"]
    assert timeline.slowest is not None and timeline.slowest[0] == "w0700"


def _ack(
    update_id: str, worker: str, phase: str, *, ok: bool, took: float = 0.1, error: str = ""
) -> dict[str, object]:
    return {
        "type": "ack",
        "update_id": update_id,
        "phase": phase,
        "worker_id": worker,
        "ok": ok,
        "world_size": 1,
        "adapters": [],
        "paused": True,
        "duration_s": took,
        "error": None if ok else {"code": "engine_error", "message": error},
    }


def _record(seq: int, kind: str, message: dict[str, object]) -> TrailRecord:
    # An ack on its sender's subject: one claiming another is not drawn.
    subject = f"lorabus.t.ack.{message['worker_id']}" if kind == "ack" else f"lorabus.t.{kind}"
    return TrailRecord(seq=seq, subject=subject, ts=100.0 + seq / 1000, kind=kind, message=message)


def _line(record: TrailRecord) -> str:
    return msgspec.json.encode(record).decode()


def test_only_updates_are_drawn_fenced_acks_are_no_failure_and_the_silent_are_named() -> None:
    """A term's notice or a refusal carries an update id that names no update;
    an ack refusing a deposed leader's late command is no failure of its
    worker; a member the coordinator gave up waiting for is marked; values of
    the wrong type or beyond any calendar draw nothing wrong and raise nothing."""
    started = {
        "type": "update_started",
        "update_id": "u1",
        "adapter": "policy",
        "version": True,
        "members": {"w0": 1, "w1": True, "w2": 1},
    }
    fenced = _ack("u1", "w0", "pause", ok=False, error="it has seen epoch 2")
    fenced["error"] = {"code": "fenced", "message": "it has seen epoch 2"}
    records = [
        _record(1, "event", started),
        _record(2, "ack", {**_ack("u1", "w0", "load", ok=True), "duration_s": True}),
        _record(3, "ack", fenced),
        _record(4, "ack", _ack("u1", "w1", "load", ok=True)),
        _record(
            5,
            "event",
            {
                "type": "phase_finished",
                "update_id": "u1",
                "phase": "load",
                "ok": False,
                "duration_s": 0.5,
                "missing": ["w2"],
            },
        ),
        _record(6, "command", {"type": "committed", "update_id": "term-3"}),
        _record(7, "command", {"type": "refuse_instance", "update_id": "conflict"}),
        TrailRecord(
            seq=8,
            subject="lorabus.t.evt",
            ts=1e20,
            kind="event",
            message={**started, "update_id": "far"},
        ),
    ]

    timelines = build_timelines(records)
    page = render_page(timelines)

    assert [t.update_id for t in timelines] == ["u1", "far"]
    (u1, _far) = timelines
    assert u1.version is None and u1.workers["w1"].world_size == 1, "from its ack, not True"
    assert [b.duration_s for b in u1.workers["w0"].bars] == [0.0]
    assert [r.worker_id for r in u1.failed] == ["w2"]
    assert u1.workers["w2"].error == "no answer in load"
    rows = _parse(page).sections["u1"]
    assert [w for w, row in rows.items() if "failed" in row.classes] == ["w2"]


async def test_a_page_that_cannot_be_written_is_said_plainly(tmp_path: Path) -> None:
    trail = tmp_path / "trail.jsonl"
    trail.write_text(_line(_record(1, "ack", _ack("u1", "w000", "load", ok=True))) + "\n")
    finished = await run_lorabus(
        "audit", "timeline", str(trail), "--out", str(tmp_path / "missing" / "page.html")
    )
    assert finished.returncode == 1 and "cannot write" in finished.stderr, finished
    assert "Traceback" not in finished.stderr
