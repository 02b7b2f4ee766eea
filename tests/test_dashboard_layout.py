"""The dashboard read at a glance: nothing drawn over anything at 1280 px and up, plans over the budget
flagged, history rows each at the length its plan was made for, reasons in sentences (headless Chromium, a
live service)."""

from __future__ import annotations

import os

import httpx
import pytest

from .dashboard_helpers import ARTIFACTS, CHROMIUM, browser_session, new_page, served_jobs
from .helpers import LiveServer
from .test_plan_rows import letters

served = pytest.fixture(scope="module")(served_jobs)
# Every cell's content stays inside the cell: nothing is drawn over a neighbour.
_OVERFLOWS = """() => {
  const bad = [];
  for (const cell of document.querySelectorAll('table td, table th')) {
    if (!cell.getClientRects().length) continue;
    const r = cell.getBoundingClientRect();
    const where = (cell.closest('table').id || '?') + ' "' + cell.textContent.trim().slice(0, 30) + '"';
    if (cell.scrollWidth > cell.clientWidth + 1) {
      bad.push(where + ': content ' + cell.scrollWidth + ' > ' + cell.clientWidth);
    }
    for (const child of cell.querySelectorAll('*')) {
      const c = child.getBoundingClientRect();
      if (c.width && (c.left < r.left - 1 || c.right > r.right + 1)) {
        bad.push(where + ': ' + child.className + ' spans ' + Math.round(c.left) + '-' + Math.round(c.right) +
                 ' in a cell at ' + Math.round(r.left) + '-' + Math.round(r.right));
        break;
      }
    }
  }
  return bad;
}"""


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
@pytest.mark.parametrize("width", [1280, 1400])
def test_dashboard_draws_nothing_over_anything_and_flags_plans_over_budget(served: LiveServer, width: int) -> None:
    job = httpx.get(f"{served.url}/api/v1/jobs/train-gpt", timeout=10).json()
    budget = job["budget_bytes"]
    table = job["plan"]["shape_plans"]
    over = [e["max_seq_len"] for e in table if e["predicted_peak_bytes"] > budget]
    assert over and len(over) < len(table), "the tight job has plans that fit and plans that cannot"
    pw, browser = browser_session()
    try:
        page = browser.new_page(viewport={"width": width, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        ARTIFACTS.mkdir(exist_ok=True)
        for name in ("train-gpt", "modes-job", "sim-job"):
            page.goto(f"{served.url}/#job={name}")
            page.wait_for_function(f"document.body.dataset.ready === '1' && location.hash === '#job={name}'")
            assert page.evaluate(_OVERFLOWS) == [], f"{name} at {width} px"
            assert page.evaluate("document.documentElement.scrollWidth") <= width, "the page scrolls sideways"
            wrap = page.locator("#jobs-table").evaluate("t => [t.parentNode.scrollWidth, t.parentNode.clientWidth]")
            assert wrap[0] <= wrap[1], f"the jobs table is wider than its box at {width} px: {wrap}"
            page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}-{width}.png"), full_page=True)
        page.goto(f"{served.url}/#job=train-gpt")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=train-gpt'")
        # Every row whose prediction passes the budget says so, and what rematd does at those lengths.
        flagged = page.locator("#plan-table-body tr.over-budget").evaluate_all(
            "rs => rs.map(r => +r.dataset.maxSeqLen)"
        )
        assert flagged == over
        for seq in over:
            fit = page.locator(f'#plan-table-body tr[data-max-seq-len="{seq}"] td.fit').inner_text()
            assert "over budget" in fit and "leanest plan" in fit and "out of memory" in fit, fit
        fine = page.locator("#plan-table-body tr:not(.over-budget) td.fit").all_inner_texts()
        assert len(fine) == len(table) - len(over) and all(t.startswith("fits") for t in fine), fine
        assert errors == []
    finally:
        browser.close()
        pw.stop()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_dashboard_history_rows_speak_of_their_own_length_in_plain_sentences(served: LiveServer) -> None:
    plans = httpx.get(f"{served.url}/api/v1/jobs/train-gpt/plans", timeout=10).json()["plans"]
    assert any(p["shape_plans"] for p in plans), "the job plans by length"
    assert len({p["seq_len"] for p in plans}) >= 2, "the job's plans were made at several lengths"

    def at(p: dict) -> dict:  # type: ignore[type-arg]
        # The entry a step of the length the plan was made at runs: its modes, peak and overhead, all of one row.
        return next(
            (e for e in p["shape_plans"] if e["max_seq_len"] >= p["seq_len"]),
            p["shape_plans"][-1] if p["shape_plans"] else p,
        )

    pw, browser = browser_session()
    try:
        page, errors = new_page(browser, 900)
        page.goto(f"{served.url}/#job=train-gpt")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=train-gpt'")
        assert "at that length" in (page.locator("#plan-history-modes").text_content() or "")
        rows = page.locator("#plan-body tr[data-version]")
        assert rows.count() == len(plans)
        for k, p in enumerate(plans):
            row, entry = rows.nth(k), at(p)
            assert row.locator("td.seq").inner_text() == str(p["seq_len"])
            assert row.locator(".strip").get_attribute("data-modes") == letters(entry["modes"])
            assert row.locator("td.peak").inner_text() == _fmt_bytes(entry["predicted_peak_bytes"])
            assert row.locator("td.overhead").inner_text() == f"{entry['predicted_overhead_ratio'] * 100:.1f}%"
            reason = row.locator("td.reason").inner_text()
            # Sentences, not the planner's notation: no arrows, no letter strips, no key to the letters.
            assert reason and reason[0].isupper() and reason.endswith("."), reason
            assert "->" not in reason and "(. store" not in reason and "length <= " not in reason, reason
        assert errors == []
    finally:
        browser.close()
        pw.stop()


def _fmt_bytes(n: int) -> str:
    """The dashboard's own rounding of a byte count."""
    v, i, units = float(n), 0, ["B", "KiB", "MiB", "GiB"]
    while v >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    if i == 0:
        return f"{round(v)} B"
    return f"{v:.0f} {units[i]}" if v >= 100 else f"{v:.1f} {units[i]}" if v >= 10 else f"{v:.2f} {units[i]}"
