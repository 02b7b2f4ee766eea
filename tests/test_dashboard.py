"""The dashboard in headless Chromium against a live ``rematd serve`` with real jobs streamed into it."""

from __future__ import annotations

import os
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from rematd import client, wire
from rematd.records import Hello
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import LiveServer, live_server, tiny_model, train_step
from .test_service import _fields, hello, stats

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def simulated_rank(target: str, rank: int) -> None:
    """One rank of a two-rank job over a real stream: pressure, an OOM, then relief; it applies each plan."""
    h = Hello(**{**_fields(hello(job="sim-job", rank=rank, n=8)), "device_name": "NVIDIA H100"})
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    outbox.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
    with grpc.insecure_channel(target) as ch:
        replies = pb_grpc.AdvisorStub(ch).Session(iter(outbox.get, None), timeout=30)
        version = next(replies).plan.version
        for step in range(40):
            seq = 128 if 10 <= step < 25 else 64
            peak = 9_600 if seq == 128 and step < 13 else 3_000 + 40 * step + 300 * rank
            msg = wire.stats_to_pb(stats(step, peak, seq=seq))
            msg.plan_version = version
            outbox.put(pb.ClientMessage(stats=msg))
            if step == 11 and rank == 0:
                outbox.put(pb.ClientMessage(oom=pb.OomEvent(step=step, message="CUDA out of memory (simulated)")))
            while True:
                reply = next(replies)
                if reply.WhichOneof("kind") == "plan":
                    version = reply.plan.version
                elif reply.ack.step == step:
                    break
        outbox.put(pb.ClientMessage(goodbye=pb.Goodbye(reason="done")))
        outbox.put(None)
        list(replies)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("dash")) as srv:
        # A real training job: a tiny GPT on the CPU, its sequence length growing mid-run.
        model = tiny_model(n_layer=4, d_model=32, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=srv.grpc, job="train-gpt", budget_bytes=1_500_000, optimizer=opt)
        for step, seq in enumerate([32] * 4 + [128] * 6 + [32] * 4):
            train_step(model, opt, seq, seed=step)
            assert h.flush(20.0)
        h.close()
        for rank in (0, 1):
            simulated_rank(srv.grpc, rank)
        yield srv


def _browser():  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
              "--disable-sync"],
    )  # fmt: skip
    return pw, browser


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian package 'chromium' is absent")
def test_dashboard_renders_jobs_chart_markers_ranks_and_history(served: LiveServer) -> None:
    pw, browser = _browser()
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{served.url}/#job=sim-job")
        page.wait_for_selector("body[data-ready]", timeout=15_000)

        rows = page.locator("#jobs-body tr[data-job]")
        assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.job)")) == ["sim-job", "train-gpt"]
        sim = page.locator('#jobs-body tr[data-job="sim-job"]')
        assert sim.locator("td.oom-risk").inner_text().endswith("%")
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
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
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
