"""The dashboard at 1400 and 800 px (headless Chromium, a live service, real CPU training): no text on the chart
over another, even where plan versions change step after step; no table clipped without a hint that it
scrolls; lossy plans badged on the job and in the history; each history row at the length its plan was made
for; a budget far above the peaks leaves them readable."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from rematd import client
from rematd.client.blocks.compress import CompressConfig

from .dashboard_helpers import ARTIFACTS, CHROMIUM, browser_session, new_page
from .helpers import LiveServer, live_server, tiny_model, train_step
from .test_plan_rows import letters

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")

PINS = [
    ["recompute", "store", "store", "store"],
    ["recompute", "recompute", "store", "store"],
    ["compress", "recompute", "store", "store"],
    ["recompute", "recompute", "recompute", "store"],
    ["store", "selective", "store", "store"],
    ["selective", "selective", "recompute", "recompute"],
]
"""Operator pins, one a step: a new plan version at each of six steps in a row."""


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("fit")) as srv:
        model = tiny_model(n_layer=4, d_model=32, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(
            model, server=srv.grpc, job="crowded", budget_bytes=10**9, optimizer=opt,
            modes=["store", "selective", "recompute", "compress"], compress=CompressConfig(min_bytes=1024),
        )  # fmt: skip
        url = f"{srv.url}/api/v1/jobs/crowded"
        for step in range(30):
            if 4 <= step < 4 + len(PINS):
                assert httpx.post(f"{url}/pin", json={"modes": PINS[step - 4]}, timeout=10).status_code == 200
            elif step == 4 + len(PINS):
                assert httpx.delete(f"{url}/pin", timeout=10).status_code == 200
            if step == 24:
                h.pin_modes("compress")  # in the training process: the job runs lossy from here
            train_step(model, opt, 32 if step < 15 else 64, seed=step)
            assert h.flush(20.0)
        h.close()
        # A budget thousands of times any peak (21 GiB for a few hundred KiB).
        roomy = tiny_model(n_layer=4, d_model=32, seed=4)
        opt = torch.optim.SGD(roomy.parameters(), lr=0.01)
        h = client.attach(roomy, server=srv.grpc, job="roomy", budget_bytes=21 * 2**30, optimizer=opt)
        for step in range(8):
            train_step(roomy, opt, 32 if step < 4 else 96, seed=step)
            assert h.flush(20.0)
        h.close()
        yield srv


# Every pair of texts drawn on the chart, as the browser lays them out: none may touch another.
_OVERLAPS = """() => {
  const chart = document.getElementById('chart').getBoundingClientRect();
  const boxes = [...document.querySelectorAll('#chart text')].map(t => [t.textContent, t.getBoundingClientRect()])
    .filter(([, r]) => r.width > 0);
  const bad = [];
  boxes.forEach(([a, r], i) => {
    if (r.left < chart.left - 0.5 || r.right > chart.right + 0.5 || r.top < chart.top - 0.5 ||
        r.bottom > chart.bottom + 0.5) bad.push(a + ' leaves the chart');
    boxes.slice(i + 1).forEach(([b, q]) => {
      const w = Math.min(r.right, q.right) - Math.max(r.left, q.left);
      const h = Math.min(r.bottom, q.bottom) - Math.max(r.top, q.top);
      if (w > 0.5 && h > 0.5) bad.push('"' + a + '" over "' + b + '"');
    });
  });
  return [boxes.length, bad];
}"""

# Every table wider than its box has a visible hint above it that it scrolls; the tables that do, by id.
_CLIPPED = """() => [...document.querySelectorAll('.table-wrap')].filter(w => w.getClientRects().length).map(w => {
  const hint = w.previousElementSibling;
  const shown = !!hint && hint.classList.contains('scroll-hint') && !hint.hidden && hint.getClientRects().length > 0
    && /scroll/.test(hint.textContent);
  return [w.querySelector('table').id, w.scrollWidth > w.clientWidth + 1, shown];
})"""


@pytest.mark.parametrize("width", [1400, 800])
def test_no_text_overlaps_on_the_chart_and_no_table_clips_without_a_hint(crowded: LiveServer, width: int) -> None:
    plans = httpx.get(f"{crowded.url}/api/v1/jobs/crowded/plans", timeout=10).json()["plans"]
    assert len(plans) >= 1 + len(PINS), [p["version"] for p in plans]
    pw, browser = browser_session()
    try:
        page = browser.new_page(viewport={"width": width, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{crowded.url}/#job=crowded")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=crowded'")
        markers = page.locator("#chart line.marker").count()
        assert markers >= len(PINS), markers
        count, overlaps = page.evaluate(_OVERLAPS)
        assert count > 10 and overlaps == [], (width, overlaps)
        labels = page.locator("#chart text.marker-label").all_text_contents()
        assert labels and all(t.startswith("v") for t in labels), labels
        tables = page.evaluate(_CLIPPED)
        assert all(shown == clipped for _, clipped, shown in tables), (width, tables)
        jobs_clipped = dict((t, c) for t, c, _ in tables)["jobs-table"]
        assert jobs_clipped == (width < 1280), f"the jobs table at {width} px: clipped {jobs_clipped}"
        if jobs_clipped:
            # Scrolled to its end, the hint points back.
            page.locator("#jobs-table").evaluate("t => { t.parentNode.scrollLeft = 1e6; }")
            page.wait_for_function("document.querySelector('.scroll-hint').textContent.startsWith('←')")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"dashboard-crowded-{width}.png"), full_page=True)
        assert errors == []
    finally:
        browser.close()
        pw.stop()


def test_lossy_plans_are_badged_and_history_rows_show_their_own_length(crowded: LiveServer) -> None:
    job = httpx.get(f"{crowded.url}/api/v1/jobs/crowded", timeout=10).json()
    plans = httpx.get(f"{crowded.url}/api/v1/jobs/crowded/plans", timeout=10).json()["plans"]
    assert job["in_force"]["lossy"] and job["in_force"]["source"] == "ranks", job["in_force"]
    lossy = [any("compress" in ms for ms in [p["modes"], *(e["modes"] for e in p["shape_plans"])]) for p in plans]
    assert any(lossy) and not all(lossy)
    assert {p["seq_len"] for p in plans} >= {32, 64}, [p["seq_len"] for p in plans]
    versions = [p["version"] for p in plans]
    assert len(versions) == len(set(versions))
    pw, browser = browser_session()
    try:
        page, errors = new_page(browser, 1000)
        page.goto(f"{crowded.url}/#job=crowded")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=crowded'")
        row = page.locator('#jobs-body tr[data-job="crowded"] td.plan')
        assert row.locator(".lossy-tag").count() == 1 and "as the ranks ran" in row.inner_text()
        assert row.locator(".strip").get_attribute("data-modes") == "CCCC"
        rows = page.locator("#plan-body tr[data-version]")
        assert rows.count() == len(plans)
        for k, p in enumerate(plans):
            r = rows.nth(k)
            assert (r.locator("td.reason .lossy-tag").count() == 1) == lossy[k], (p["version"], p["reason"])
            assert r.locator("td.seq").inner_text() == str(p["seq_len"])
            entry = next((e for e in p["shape_plans"] if e["max_seq_len"] >= p["seq_len"]), None)
            want = entry["modes"] if entry else (p["shape_plans"][-1]["modes"] if p["shape_plans"] else p["modes"])
            assert r.locator(".strip").get_attribute("data-modes") == letters(want), p["version"]
        assert errors == []
    finally:
        browser.close()
        pw.stop()


def test_a_budget_far_above_the_peaks_leaves_them_readable(crowded: LiveServer, tmp_path: Path) -> None:
    pw, browser = browser_session()
    try:
        page, errors = new_page(browser, 1000)
        page.goto(f"{crowded.url}/#job=roomy")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=roomy'")
        legend = page.locator("#chart-legend").inner_text()
        assert "budget 21.0 GiB, above the chart" in legend, legend
        # The peaks fill the plot's height rather than lie flat at its floor.
        top = page.locator("#chart polyline[data-rank]").evaluate("p => Math.min(...[...p.points].map(q => q.y))")
        height = page.locator("#chart").evaluate("c => c.viewBox.baseVal.height")
        assert top < height / 2, (top, height)
        assert errors == []
    finally:
        browser.close()
        pw.stop()
