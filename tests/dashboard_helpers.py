"""A live ``rematd serve`` with real and simulated jobs streamed into it, and headless Chromium to read it."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from rematd import client, wire
from rematd.planner import Shape
from rematd.planner.messages import Hello, StepStats
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import LiveServer, live_server, tiny_model, train_step
from .test_plan_rows import LENGTHS, modes_hello
from .test_service import _fields, hello, stats

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def _until_acked(replies: Iterator[pb.ServerMessage], step: int, version: int) -> int:
    """Read the replies up to ``step``'s ack; the plan version in force after them."""
    while True:
        reply = next(replies)
        if reply.WhichOneof("kind") == "plan":
            version = reply.plan.version
        elif reply.ack.step == step:
            return version


def _goodbye(outbox: queue.Queue[pb.ClientMessage | None], replies: Iterator[pb.ServerMessage]) -> None:
    outbox.put(pb.ClientMessage(goodbye=pb.Goodbye(reason="done")))
    outbox.put(None)
    list(replies)


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
            version = _until_acked(replies, step, version)
        _goodbye(outbox, replies)


def modes_rank(target: str) -> None:
    """A rank whose blocks may store, go selective or recompute, its lengths growing: plans change modes by length."""
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    outbox.put(pb.ClientMessage(hello=wire.hello_to_pb(modes_hello("modes-job"))))
    with grpc.insecure_channel(target) as ch:
        replies = pb_grpc.AdvisorStub(ch).Session(iter(outbox.get, None), timeout=30)
        version = next(replies).plan.version
        for step, seq in enumerate(LENGTHS):
            shape = Shape(batch=1, seq_len=seq, tokens=seq)
            peak = 6000 if seq == 64 else 9000
            # Its blocks compiled as the run began (attach(..., compile=True)): 3 graphs, then 2 at a new length.
            compiled = {0: 3, 3: 2}.get(step, 0)
            msg = StepStats(
                step=step,
                saved_peak_bytes=peak,
                budget_bytes=10_000,
                shape=shape,
                plan_version=version,
                recompiles=compiled,
            )
            outbox.put(pb.ClientMessage(stats=wire.stats_to_pb(msg)))
            version = _until_acked(replies, step, version)
        _goodbye(outbox, replies)


def served_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live service holding a real tiny-GPT job under a tight budget, a simulated two-rank job with an
    OOM, and a job whose plans change modes by length (use it as a module-scoped fixture)."""
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
        modes_rank(srv.grpc)
        yield srv


def browser_session():  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
              "--disable-sync"],
    )  # fmt: skip
    return pw, browser


def new_page(browser, height: int | None = None):  # type: ignore[no-untyped-def]
    """A new page (1400 wide by ``height``, or the default size) and the list its script errors go to."""
    page = browser.new_page(viewport={"width": 1400, "height": height}) if height else browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page, errors


def rank_prices(url: str, job: str) -> str:
    """The price line of ``job``'s rank, as the dashboard (real Chromium) shows it."""
    pw, browser = browser_session()
    try:
        page, errors = new_page(browser)
        page.goto(f"{url}/#job={job}")
        page.wait_for_selector("#ranks-body tr[data-rank] .prices", timeout=15_000)
        text = page.locator("#ranks-body tr[data-rank] .prices").inner_text()
        assert errors == []
        return text
    finally:
        browser.close()
        pw.stop()
