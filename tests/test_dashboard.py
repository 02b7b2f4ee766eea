"""The dashboard in headless Chromium against a live ``rematd serve`` with real jobs streamed into it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .dashboard_helpers import ARTIFACTS, CHROMIUM, served_jobs
from .dashboard_helpers import browser_session as _browser
from .dashboard_helpers import new_page as _page
from .helpers import LiveServer, live_server
from .test_plan_rows import letters
from .test_service import hello, stats

served = pytest.fixture(scope="module")(served_jobs)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_dashboard_renders_jobs_chart_markers_ranks_and_history(served: LiveServer) -> None:
    pw, browser = _browser()
    try:
        page, errors = _page(browser, 1100)
        page.goto(f"{served.url}/#job=sim-job")
        page.wait_for_selector("body[data-ready]", timeout=15_000)

        rows = page.locator("#jobs-body tr[data-job]")
        assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.job)")) == ["modes-job", "sim-job", "train-gpt"]
        sim = page.locator('#jobs-body tr[data-job="sim-job"]')
        assert "ended" in sim.locator("td").nth(1).inner_text()
        assert sim.locator("td.oom-risk").inner_text() == "—", "an ended job shows no live risk"
        assert page.locator("#ranks-body td.oom-risk").all_inner_texts() == ["—", "—"]
        assert sim.locator("td").nth(9).inner_text() == "1", "the OOM count is shown"

        # The chart: a line per rank, plan changes and the OOM marked.
        assert page.locator("#chart polyline[data-rank]").count() == 2
        assert page.locator("#chart line.marker").count() >= 1
        oom = page.locator("#chart line.oom-marker")
        assert oom.count() == 1 and "step 11" in (oom.locator("title").text_content() or "")
        # The per-rank view and the plan history.
        assert page.locator("#ranks-body tr[data-rank]").count() == 2
        assert page.locator("#token-form").is_hidden(), "reads on loopback need no token"
        versions = page.locator("#plan-body tr[data-version]").evaluate_all("rs => rs.map(r => +r.dataset.version)")
        assert len(versions) >= 3 and page.locator("#plan-body tr.current").count() >= 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-sim-job.png"), full_page=True)

        # The real training job, chosen by a click.
        page.locator('#jobs-body tr[data-job="train-gpt"]').click()
        page.wait_for_function("location.hash === '#job=train-gpt' && document.body.dataset.ready === '1'")
        assert page.locator("#chart polyline[data-rank]").count() == 1
        assert page.locator("#plan-body tr[data-version]").count() >= 2, "the long sequences changed the plan"
        assert "Job train-gpt" in page.locator("#detail-title").inner_text()
        page.screenshot(path=str(ARTIFACTS / "dashboard-train-gpt.png"), full_page=True)
        assert errors == []
    finally:
        browser.close()
        pw.stop()


TOKEN = "dashboard-token-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A service as the image, compose and Kubernetes run it: HTTP beyond loopback, a token, no --public-reads."""
    srv_args = ("--http-host", "0.0.0.0", "--grpc-host", "127.0.0.1")
    with live_server(tmp_path_factory.mktemp("guarded"), args=srv_args, env={"REMATD_TOKEN": TOKEN}) as srv:
        with grpc.insecure_channel(srv.grpc) as ch:
            msgs = [
                pb.ClientMessage(hello=wire.hello_to_pb(hello(job="guarded-job"))),
                pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))),
            ]
            call = pb_grpc.AdvisorStub(ch).Session(iter(msgs), metadata=[("authorization", f"Bearer {TOKEN}")])
            assert [m.WhichOneof("kind") for m in call] == ["plan", "ack"]
        yield f"http://127.0.0.1:{srv.http.rsplit(':', 1)[1]}"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_dashboard_asks_for_the_token_when_reads_need_it(guarded: str) -> None:
    pw, browser = _browser()
    try:
        page, errors = _page(browser)
        page.goto(guarded)
        page.wait_for_selector("#token-form:not([hidden])", timeout=15_000)
        assert "token" in page.locator("#error-banner").inner_text()
        assert page.locator("#jobs-body tr[data-job]").count() == 0
        page.fill("#token", "not-the-token-at-all")
        page.click("#token-form button[type=submit]")
        page.wait_for_function("document.getElementById('error-banner').textContent.includes('refused')")
        page.fill("#token", TOKEN)
        page.click("#token-form button[type=submit]")
        page.wait_for_selector('#jobs-body tr[data-job="guarded-job"]', timeout=15_000)
        page.wait_for_selector("#error-banner", state="hidden", timeout=15_000)
        assert TOKEN not in page.url
        # Kept for the tab: a reload shows the jobs at once; forgetting it asks again.
        page.reload()
        page.wait_for_selector('#jobs-body tr[data-job="guarded-job"]', timeout=15_000)
        page.click("#token-forget")
        page.wait_for_function("document.getElementById('error-banner').textContent.includes('needs its token')")
        assert page.evaluate("sessionStorage.getItem('rematd-token')") is None
        assert errors == []
    finally:
        browser.close()
        pw.stop()


def _legend_styles(page) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [
        (item["label"], item["style"])
        for item in page.locator("#chart-legend .item").evaluate_all(
            """items => items.map(i => {
                 const l = i.querySelector('line');
                 return {label: i.textContent, style: ['stroke', 'stroke-dasharray', 'stroke-width']
                   .map(a => l.getAttribute(a) || '').join('|')};
               })"""
        )
    ]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_dashboard_shows_the_modes_in_force_by_length(served: LiveServer) -> None:
    job = httpx.get(f"{served.url}/api/v1/jobs/modes-job", timeout=10).json()
    plans = httpx.get(f"{served.url}/api/v1/jobs/modes-job/plans", timeout=10).json()["plans"]
    table = plans[-1]["shape_plans"]
    assert len({letters(e["modes"]) for e in table}) >= 3, "the job's plan changes modes by length"
    force = job["in_force"]
    assert force["seq_len"] == 128 and force["modes"] != table[-1]["modes"]
    pw, browser = _browser()
    try:
        page, errors = _page(browser, 1300)
        page.goto(f"{served.url}/#job=modes-job")
        page.wait_for_selector("body[data-ready]", timeout=15_000)

        # The job row: the plan in force for the last step's length, not the table's top entry.
        cell = page.locator('#jobs-body tr[data-job="modes-job"] td.plan')
        assert f"len 128 (≤{force['max_seq_len']})" in cell.inner_text()
        assert cell.locator(".strip").get_attribute("data-modes") == letters(force["modes"])
        # The graphs its ranks compiled, kept in the store after the job ended.
        assert job["recompiles"] == 5
        row = page.locator('#jobs-body tr[data-job="modes-job"]')
        assert row.locator("td.recompiles").inner_text() == "5"
        assert page.locator('#jobs-body tr[data-job="sim-job"] td.recompiles').inner_text() == "0"
        # The table of modes per length: a strip per length, one cell per block coloured by mode.
        rows = page.locator("#plan-table-body tr[data-max-seq-len]")
        assert rows.count() == len(table)
        strips = rows.locator(".strip").evaluate_all("ss => ss.map(s => s.dataset.modes)")
        assert strips == [letters(e["modes"]) for e in table]
        assert page.locator("#plan-table-body .strip").first.locator(".cell").count() == 8
        for mode in ("store", "selective", "recompute"):
            assert page.locator(f"#plan-table-body .cell.mode-{mode}").count() >= 1, mode
        colours = page.locator("#plan-table-body .cell").evaluate_all(
            "cs => [...new Set(cs.map(c => c.className + '=' + getComputedStyle(c).backgroundColor))]"
        )
        assert len({c.split("=")[1] for c in colours}) == len({c.split("=")[0] for c in colours}) >= 3, colours
        current = page.locator("#plan-table-body tr.in-force")
        assert current.count() == 1 and current.get_attribute("data-max-seq-len") == str(force["max_seq_len"])
        # The rank shows the same modes; the history has a strip per plan.
        assert page.locator("#ranks-body .strip").get_attribute("data-modes") == letters(force["modes"])
        history = page.locator("#plan-body tr[data-version] .strip").evaluate_all("ss => ss.map(s => s.dataset.modes)")

        def at_own(p: dict) -> str:  # type: ignore[type-arg]
            table = p["shape_plans"]
            return letters(next((e["modes"] for e in table if e["max_seq_len"] >= p["seq_len"]), table[-1]["modes"]))

        assert history == [at_own(p) for p in plans], "each plan at the length it was made for"
        assert page.locator("#plan-body td.seq").all_inner_texts() == [str(p["seq_len"]) for p in plans]
        assert any("Up to length" in r for r in page.locator("#plan-body td.reason").all_inner_texts())
        assert not any("extend the plan table" in r for r in page.locator("#plan-body td.reason").all_inner_texts())
        # The legend tells every series apart: no two items share a label or a style.
        page.goto(f"{served.url}/#job=sim-job")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=sim-job'")
        page.wait_for_selector("#chart line.oom-marker", state="attached", timeout=15_000)
        styles = _legend_styles(page)
        assert {label for label, _ in styles} >= {"budget", "OOM event", "plan change"}
        assert len({label for label, _ in styles}) == len(styles) and len({st for _, st in styles}) == len(styles)
        oom = page.locator("#chart line.oom-marker").first.evaluate("l => getComputedStyle(l).stroke")
        budget = page.locator("#chart path.budget").evaluate("p => getComputedStyle(p).stroke")
        assert oom != budget
        ARTIFACTS.mkdir(exist_ok=True)
        page.goto(f"{served.url}/#job=modes-job")
        page.wait_for_function("document.body.dataset.ready === '1' && location.hash === '#job=modes-job'")
        page.screenshot(path=str(ARTIFACTS / "dashboard-modes-job.png"), full_page=True)
        assert errors == []
    finally:
        browser.close()
        pw.stop()


def _refused(served: LiveServer) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('rematd_unauthenticated_requests_total{transport="http"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_a_page_of_another_origin_cannot_write_and_docs_render_offline(served: LiveServer) -> None:
    port = served.http.rsplit(":", 1)[1]
    pw, browser = _browser()
    try:
        page = browser.new_page()
        # Another origin (another host name for the same machine) tries what a hostile page would.
        page.goto(f"http://localhost:{port}/healthz")
        before = _refused(served)
        page.evaluate(
            """async base => {
                 await fetch(base + '/api/v1/jobs/modes-job/end', {method: 'POST', mode: 'no-cors'});
                 await fetch(base + '/api/v1/jobs/modes-job/pin', {method: 'POST', mode: 'no-cors',
                   headers: {'content-type': 'text/plain'}, body: JSON.stringify({checkpoint_every: 1})});
               }""",
            f"http://127.0.0.1:{port}",
        )
        # /metrics serves one render a second: wait for one made after the writes.
        deadline = time.monotonic() + 10
        while _refused(served) != before + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _refused(served) == before + 2, "both writes reached the service and were refused"
        controls = httpx.get(f"{served.url}/api/v1/jobs/modes-job", timeout=10).json()["controls"]
        assert controls["ended_at"] is None and controls["pin_every"] is None
        # The dashboard's own origin may write (an operator's page or tool on the service's machine).
        page.goto(f"http://127.0.0.1:{port}/healthz")
        status = page.evaluate(
            """async () => (await fetch('/api/v1/jobs/modes-job/pin', {method: 'POST',
                 headers: {'content-type': 'application/json'}, body: JSON.stringify({checkpoint_every: 2})})).status"""
        )
        assert status == 200
        assert (
            page.evaluate("async () => (await fetch('/api/v1/jobs/modes-job/pin', {method: 'DELETE'})).status") == 200
        )

        # /docs with every request off the service refused: it renders from the service's own files.
        elsewhere: list[str] = []

        def local_only(route) -> None:  # type: ignore[no-untyped-def]
            if route.request.url.startswith(f"http://127.0.0.1:{port}/"):
                route.continue_()
            else:
                elsewhere.append(route.request.url)
                route.abort()

        page.route("**/*", local_only)
        page.goto(f"http://127.0.0.1:{port}/docs")
        page.wait_for_selector(".swagger-ui .opblock", timeout=15_000)
        assert page.locator(".swagger-ui .opblock").count() >= 8
        assert "/api/v1/jobs/{job}/pin" in page.locator(".swagger-ui").inner_text()
        assert elsewhere == []
    finally:
        browser.close()
        pw.stop()
