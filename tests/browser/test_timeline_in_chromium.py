"""The update timeline as a person sees it: the page that ``lorabus audit
timeline`` draws from a real fleet's trail, rendered by a real headless
Chromium (Debian's ``chromium``; ``scripts/install-browser``).

What is checked is what the browser laid out and painted, not the HTML text:
a probe script added to a copy of the page reports each worker row's box
and the computed colours of its bars and badges, read back with
``--dump-dom``. The page itself is also shot as a screenshot, kept under
``test-artifacts/browser/`` for a person to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from processes import run_lorabus

from lorabus.audit.verify import TrailRecord
from lorabus.testbed.stack import EmbeddedStack

pytestmark = pytest.mark.browser

WORKERS = {"w000": 1, "w001": 2, "w002": 1, "w003": 4}
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"
BROWSER_DEADLINE_S = 90.0
FAILED_RED = "rgb(208, 2, 27)"

_PROBE = """
<script>
window.addEventListener("load", () => {
  const seen = {};
  for (const section of document.querySelectorAll("section.update")) {
    seen[section.id] = [...section.querySelectorAll(".row.worker")].map((row) => {
      const box = row.getBoundingClientRect();
      const bars = [...row.querySelectorAll(".bar")].map((bar) => ({
        cls: bar.className,
        width: bar.getBoundingClientRect().width,
        color: getComputedStyle(bar).backgroundColor,
      }));
      const badge = row.querySelector(".badge.failed");
      return {
        worker: row.dataset.worker,
        height: box.height,
        width: box.width,
        background: getComputedStyle(row).backgroundColor,
        failedBadge: badge ? badge.getBoundingClientRect().width : 0,
        text: row.innerText,
        bars,
      };
    });
  }
  const box = document.querySelector(".rows");
  seen.box = {
    clientHeight: box.clientHeight,
    scrollHeight: box.scrollHeight,
    viewport: window.innerHeight,
    page: document.documentElement.scrollHeight,
  };
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
});
</script>
"""


def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.skip("no chromium here: scripts/install-browser installs Debian's")
    return found


async def _run_browser(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        _chromium(),
        "--headless",
        "--no-sandbox",  # as root, in a container: Chromium's sandbox needs user namespaces
        "--disable-gpu",
        "--hide-scrollbars",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), BROWSER_DEADLINE_S)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
    return stdout.decode(errors="replace")


async def _probe(page: Path, tmp_path: Path) -> dict[str, Any]:
    """What the browser laid out for ``page``: its probe's report."""
    probe = tmp_path / "probe.html"
    text = await asyncio.to_thread(page.read_text)
    await asyncio.to_thread(probe.write_text, text.replace("</body>", _PROBE + "</body>"))
    dom = await _run_browser(
        "--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found is not None, dom[-2000:]
    return dict(json.loads(html.unescape(found.group(1))))


async def test_the_page_shows_a_row_per_worker_and_a_failed_worker_in_red(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
    fleet_name: str,
    tmp_path: Path,
) -> None:
    _chromium()
    trail, page = tmp_path / "trail.jsonl", tmp_path / "timeline.html"
    async with make_stack(list(WORKERS.values())) as stack:
        assert stack.client is not None and stack.sim is not None
        committed = await stack.client.update("policy", make_adapter(1), version=1)
        stack.sim.workers["w002"].set_faults(fail_next_loads=1, load_failure_status=400)
        failed = await stack.client.update("policy", make_adapter(2), version=2)
        tapped = await run_lorabus(
            "tap", "--nats", nats_url, "--fleet", fleet_name, "--no-follow", "--out", str(trail)
        )
    drawn = await run_lorabus("audit", "timeline", str(trail), "--last", "2", "--out", str(page))
    assert committed.committed and not failed.committed, (committed, failed)
    assert tapped.returncode == 0 and drawn.returncode == 0, (tapped, drawn)

    seen = await _probe(page, tmp_path)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "timeline.png"
    shot.unlink(missing_ok=True)
    await _run_browser("--window-size=1400,900", f"--screenshot={shot}", page.as_uri())

    ok_rows = {r["worker"]: r for r in seen[f"update-{committed.update_id}"]}
    bad_rows = {r["worker"]: r for r in seen[f"update-{failed.update_id}"]}
    assert set(ok_rows) == set(bad_rows) == set(WORKERS), seen
    for row in [*ok_rows.values(), *bad_rows.values()]:
        assert row["height"] > 0 and row["width"] > 0, row
        assert any(bar["width"] > 0 for bar in row["bars"]), row
    for worker, row in bad_rows.items():
        red = [bar for bar in row["bars"] if bar["color"] == FAILED_RED and bar["width"] > 0]
        if worker == "w002":
            assert red, f"the failed worker's load must be painted red: {row}"
            assert row["failedBadge"] > 0, row
            assert row["background"] != ok_rows[worker]["background"], row
            assert "injected load failure" in row["text"], row
        else:
            assert not red and row["failedBadge"] == 0, row
    assert shot.stat().st_size > 0


async def test_a_thousand_workers_scroll_in_their_box_the_slowest_first(tmp_path: Path) -> None:
    """1,024 rows stay readable: each is laid out at full height inside a box
    that scrolls, so the page itself stays about a window tall, and with
    ``--sort slowest`` the slowest worker is the first row a person sees."""
    _chromium()
    members = {f"w{i:04d}": 1 for i in range(1024)}
    records = [
        _record(
            1,
            "event",
            {
                "type": "update_started",
                "update_id": "big",
                "adapter": "policy",
                "version": 1,
                "members": members,
            },
        )
    ]
    for i, worker in enumerate(members):
        took = 9.0 if worker == "w0517" else 0.2 + (i % 7) / 100
        records.append(
            _record(
                2 + i,
                "ack",
                {
                    "type": "ack",
                    "update_id": "big",
                    "phase": "load",
                    "worker_id": worker,
                    "ok": True,
                    "world_size": 1,
                    "adapters": [],
                    "paused": True,
                    "duration_s": took,
                },
            )
        )
    trail, page = tmp_path / "trail.jsonl", tmp_path / "big.html"
    trail.write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in records))
    drawn = await run_lorabus(
        "audit", "timeline", str(trail), "--sort", "slowest", "--out", str(page)
    )
    assert drawn.returncode == 0, drawn

    seen = await _probe(page, tmp_path)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "timeline-1024.png"
    shot.unlink(missing_ok=True)
    await _run_browser("--window-size=1400,900", f"--screenshot={shot}", page.as_uri())

    rows = seen["update-big"]
    assert len(rows) == 1024 and all(r["height"] > 0 for r in rows)
    assert rows[0]["worker"] == "w0517", rows[0]
    box = seen["box"]
    assert box["scrollHeight"] > box["clientHeight"] > 0, box
    assert box["page"] < 2 * box["viewport"], "the rows scroll in their box, not the page"
    assert shot.stat().st_size > 0


def _record(seq: int, kind: str, message: dict[str, object]) -> TrailRecord:
    # An ack on its sender's subject: one claiming another is not drawn.
    subject = f"lorabus.t.ack.{message['worker_id']}" if kind == "ack" else f"lorabus.t.{kind}"
    return TrailRecord(seq=seq, subject=subject, ts=100.0 + seq / 1000, kind=kind, message=message)
