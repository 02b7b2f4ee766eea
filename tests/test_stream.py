"""The stream: fail-open across a killed service, auth metadata, TLS, fallback planning, the queue."""

from __future__ import annotations

import gc
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from bench.served import stop
from rematd import client
from rematd.client import introspect
from rematd.client.service.stream import StreamBackend, StreamConfig
from rematd.planner.messages import StepStats

from .helpers import tiny_model, train_step
from .stream_helpers import Recorder, free_port, make_cert, run_steps, serve_recorder, start_serve


def test_training_survives_a_killed_and_restarted_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Time spent in rematd's code on the training thread (its hooks and step()), per step.
    in_rematd = [0.0]
    for name in ("_pre_forward", "_post_forward", "step"):
        original = getattr(client.Handle, name)

        def timed(self: client.Handle, *args: object, _original: Any = original) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                in_rematd[0] += time.perf_counter() - start

        monkeypatch.setattr(client.Handle, name, timed)
    db = tmp_path / "rematd.db"
    proc, grpc_addr, http_addr = start_serve(db)
    procs = [proc]
    restarted: dict[str, float] = {}

    def restart() -> None:
        grpc_port, http_port = int(grpc_addr.rsplit(":", 1)[1]), int(http_addr.rsplit(":", 1)[1])
        new, _, _ = start_serve(db, grpc_port, http_port)
        procs.append(new)
        restarted["at"] = time.monotonic()

    try:
        model = tiny_model(n_layer=4, d_model=32, seed=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=grpc_addr, job="restart-job", budget_bytes=10**12, optimizer=opt)
        # The same step without rematd, interleaved: it shows when the machine itself was slow.
        control = tiny_model(n_layer=4, d_model=32, seed=4)
        control_opt = torch.optim.SGD(control.parameters(), lr=0.01)
        times: list[float] = []
        control_times: list[float] = []
        rematd_times: list[float] = []
        restarter = threading.Thread(target=restart)
        # A cyclic garbage collection (tens of ms with torch loaded) lands in whichever code allocates at the
        # threshold; it is not a wait on the network, so it is kept out of the timings.
        gc.disable()
        for step in range(200):
            if step == 5:
                assert h.flush(20.0), "the service answered before it was killed"
            if step == 6:
                before = h.plan.version  # the first plan arrived by step 5 and is in force from step 6
                assert before >= 1
            if step == 30:
                proc.kill()  # no goodbye, no graceful shutdown
                proc.wait(5)
            if step == 40:
                restarter.start()
            in_rematd[0] = 0.0
            start = time.perf_counter()
            train_step(model, opt, 32, seed=step)
            times.append(time.perf_counter() - start)
            rematd_times.append(in_rematd[0])
            start = time.perf_counter()
            train_step(control, control_opt, 32, seed=step)
            control_times.append(time.perf_counter() - start)
            time.sleep(0.02)
        gc.enable()
        restarter.join(60)
        assert "at" in restarted, "the service did not restart"
        stream = h.stream
        assert stream is not None
        while not stream.connected and time.monotonic() < restarted["at"] + 10:
            time.sleep(0.05)
        assert stream.connected_at is not None
        back = stream.connected_at - restarted["at"]
        assert stream.connected and back < 5.0, f"the stream came back {back:.1f}s after the service"
        assert h.flush(20.0)
        median, control_median = statistics.median(times), statistics.median(control_times)
        print(
            f"stream back after {back:.2f}s; median step {median * 1e3:.1f} ms, control {control_median * 1e3:.1f} ms"
        )
        # rematd's own work on the training thread never waits on the network: per step it stays well
        # under a step, across the kill, the outage and the reconnect.
        worst_rematd = max(rematd_times[1:])  # step 0 ends the profile and starts the stream thread
        print(
            f"rematd on the training thread: median {statistics.median(rematd_times) * 1e6:.0f} us, "
            f"max {worst_rematd * 1e3:.2f} ms"
        )
        # A loaded machine may preempt the thread inside rematd's code once or twice; a network wait would
        # show on many steps, and for far longer.
        slow = [f"step {i}: {t * 1e3:.1f}" for i, t in enumerate(rematd_times[1:], start=1) if t >= median]
        assert len(slow) <= 5 and worst_rematd < 0.5, f"rematd took {slow} ms of steps of {median * 1e3:.1f} ms"
        assert statistics.median(rematd_times[30:60]) < 0.1 * median, "rematd's own work grew during the outage"
        assert rematd_times[0] < 0.5
        # Whole steps. A step delayed by more than the step itself is late; on a shared virtual machine the
        # hypervisor alone makes steps late now and then, in bursts (the control run shows how often), so
        # the steps are compared as groups: the outage's steps (from the kill until after the restart) run
        # at the pace of the others, and late steps are about as common as in the control run. A wait on
        # the network (a connect, a backoff of 0.2-4 s) would slow every step of the outage, each by far
        # more than a step.
        late = [f"step {i}: {t * 1e3:.0f} ms" for i, t in enumerate(times[1:], start=1) if t > 2 * median]
        control_late = [i for i, t in enumerate(control_times[1:], start=1) if t > 2 * control_median]
        outage = times[30:60]
        print(
            f"late steps: {late}; control: {len(control_late)}; outage median {statistics.median(outage) * 1e3:.1f} ms"
        )
        # Against the control run's steps of the same window: a restarting service (or another test) taking
        # the cores for a while slows both alike; a wait on the network slows only the attached model.
        outage_ratio = statistics.median(outage) / statistics.median(control_times[30:60])
        assert outage_ratio < 1.5 * median / control_median, [round(t * 1e3) for t in outage]
        assert len(late) <= 2 * len(control_late) + 10, f"median {median * 1e3:.1f} ms; late: {late}"
        assert max(times) < 2.0, f"a step took {max(times):.2f}s"
        # The restarted service went on from the plan in force (the hello carries it): no new plan was needed.
        assert h.plan.version >= before
        h.close()
        plans = httpx.get(f"http://{http_addr}/api/v1/jobs/restart-job/plans", timeout=10).json()
        plans = plans["plans"] if isinstance(plans, dict) else plans
        versions = [p["version"] for p in plans if p["rank"] == 0]
        # The restarted service continued the history: every version once, in order, none skipped, up to the
        # one in force or one past it (a plan made for the last steps' report, which arrived after the last
        # step began and so never ran).
        assert versions == list(range(1, versions[-1] + 1)), versions
        assert h.plan.version <= versions[-1] <= h.plan.version + 1, (versions, h.plan.version)
    finally:
        for p in procs:
            stop(p)


# -- an in-process service that records what each stream carried (metadata, hellos) ----------------


@pytest.mark.allow_client_errors(reason="the service refuses a wrong token, which the client logs as an error")
def test_token_is_sent_as_bearer_metadata_and_env_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(token="s3cret")
    server, port = serve_recorder(rec)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="auth", token="s3cret", optimizer=opt)
        run_steps(model, opt, 3)
        assert h.flush(10.0)
        run_steps(model, opt, 1)
        assert rec.metadata[0]["authorization"] == "Bearer s3cret"
        assert h.plan.version == 1
        h.close()

        monkeypatch.setenv("REMATD_TOKEN", "from-env")
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="auth2", optimizer=opt)
        run_steps(model, opt, 3)
        stream = h.stream
        assert stream is not None
        deadline = time.monotonic() + 10
        while stream.last_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rec.metadata[-1]["authorization"] == "Bearer from-env"
        assert stream.last_error is not None and stream.last_error.startswith("UNAUTHENTICATED")
        run_steps(model, opt, 2)  # a refused stream is terminal for rematd, not for training
        assert h.plan.version == 0 and h.step_count == 5 and stream.reconnects == 0
        assert not h.flush(5.0), "the refused steps will never be answered"
        attempts = len(rec.metadata)
        thread = introspect.stream_thread(stream)
        assert thread is not None
        thread.join(5)  # the refusal stops the stream thread: once it has ended, nothing can try again
        assert not thread.is_alive(), "the stream thread goes on after UNAUTHENTICATED"
        assert len(rec.metadata) == attempts, "UNAUTHENTICATED is not retried"
        h.close()
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="token"):
        client.attach(tiny_model(n_layer=2, d_model=16), server="127.0.0.1:1", token="has space")


def test_tls_with_root_certificates_from_a_path(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    rec = Recorder()
    server, port = serve_recorder(rec, creds=creds)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="tls", root_certificates=cert, optimizer=opt)
        run_steps(model, opt, 3)
        assert h.flush(10.0)
        run_steps(model, opt, 1)  # a plan applies at the first forward after it arrived
        assert h.plan.version == 1 and len(rec.hellos) == 1
        h.close()
        # Without TLS the same server does not answer, and training is unaffected.
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="plain", optimizer=opt, fallback_after_s=None)
        run_steps(model, opt, 3)
        assert not h.flush(0.5) and h.plan.version == 0 and len(rec.hellos) == 1
        h.close()
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="root_certificates"):
        client.attach(tiny_model(n_layer=2), server="127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


def test_fallback_plans_locally_then_hands_back_to_the_service() -> None:
    port = free_port()
    model = tiny_model(n_layer=4, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=f"127.0.0.1:{port}", job="fb", fallback_after_s=0.3, optimizer=opt)
    run_steps(model, opt, 2)
    stream = h.stream
    assert stream is not None
    deadline = time.monotonic() + 10
    while not stream.planning_locally and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream.planning_locally
    assert h.flush(5.0), "the fallback planner answers the steps"
    assert h.last_stats is not None
    h.budget_bytes = max(1, h.last_stats.saved_peak_bytes // 3)
    run_steps(model, opt, 3)
    assert h.flush(5.0)
    run_steps(model, opt, 1)
    local = h.plan.version
    assert local >= 1 and h.plan.blocks, f"the local planner tightened: {h.plan}"
    rec = Recorder()
    server, _ = serve_recorder(rec, port=port)
    try:
        deadline = time.monotonic() + 10
        while not stream.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stream.connected and not stream.planning_locally
        # The hello carries the newest plan made in-process: the one in force, or one the local planner made
        # from the last step's figures after it was read above (a loaded machine's thread answers late).
        said = rec.hellos[-1].plan_version
        assert said >= local, "the hello carries the plan in force or a newer local one"
        run_steps(model, opt, 2)
        assert h.flush(5.0)
        assert h.plan.version == said + 1, "the service's plan continues the versions"
        h.close()
    finally:
        server.stop(None)


def test_queue_drops_the_oldest_counts_it_and_close_does_not_wait_on_a_dead_service() -> None:
    backend = StreamBackend(f"127.0.0.1:{free_port()}", lambda plan: None, StreamConfig(queue_size=4))
    start = time.perf_counter()
    for step in range(10):
        backend.send_stats(StepStats(step=step, budget_bytes=1))
    assert time.perf_counter() - start < 0.05, "putting on the queue never waits"
    assert backend.dropped == 6 and backend.sent_step == 9

    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=f"127.0.0.1:{free_port()}", job="dead", optimizer=opt, fallback_after_s=None)
    run_steps(model, opt, 3)
    start = time.perf_counter()
    h.close()
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="queue_size"):
        StreamConfig(queue_size=0)
    with pytest.raises(ValueError, match="fallback_after_s"):
        StreamConfig(fallback_after_s=-1)


@pytest.mark.allow_client_errors(reason="the service refuses the wrong token, which the client logs as an error")
def test_token_and_tls_against_the_real_service(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    token = "a-token-for-the-stream-test"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    tls = ("--token-file", str(token_file), "--tls-cert", str(cert), "--tls-key", str(key))
    proc, grpc_addr, _ = start_serve(tmp_path / "rematd.db", 0, 0, *tls)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=grpc_addr, job="secure", token=token, root_certificates=cert, optimizer=opt)
        run_steps(model, opt, 3)
        assert h.flush(20.0), "the service answered every step"
        run_steps(model, opt, 1)  # a plan applies at the first forward after it arrived
        stream = h.stream
        assert stream is not None and stream.connected and stream.last_error is None
        assert h.plan.version >= 1
        h.close()

        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(
            model, server=grpc_addr, job="intruder", token="not-" + token, root_certificates=cert, optimizer=opt
        )
        run_steps(model, opt, 3)
        stream = h.stream
        assert stream is not None
        thread = introspect.stream_thread(stream)
        assert thread is not None
        thread.join(10.0)
        assert not thread.is_alive(), "a refused stream ends"
        assert stream.last_error is not None and stream.last_error.startswith("UNAUTHENTICATED"), stream.last_error
        run_steps(model, opt, 2)
        assert h.step_count == 5 and h.plan.version == 0 and stream.reconnects == 0
        assert not h.flush(1.0)
        h.close()
    finally:
        stop(proc)


def test_a_reconnect_sends_the_budget_in_force_not_the_first_one() -> None:
    port = free_port()
    first = Recorder()
    server, _ = serve_recorder(first, port=port)
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(
        model, server=f"127.0.0.1:{port}", job="budget", budget_bytes=10**9, optimizer=opt, fallback_after_s=None
    )
    try:
        run_steps(model, opt, 3)
        assert h.flush(10.0) and first.hellos[-1].budget_bytes == 10**9
        run_steps(model, opt, 1)  # the plan that answered the hello is in force from this step
        h.budget_bytes = 12_345_678  # between steps, with no step since: the next hello must carry it
        server.stop(None)
        second = Recorder()
        server, _ = serve_recorder(second, port=port)
        deadline = time.monotonic() + 10
        while not second.hellos and time.monotonic() < deadline:
            time.sleep(0.02)
        assert second.hellos, "the stream came back"
        assert second.hellos[-1].budget_bytes == 12_345_678
        assert second.hellos[-1].plan_version == h.plan.version == 1, "and the plan version in force"
    finally:
        h.close()
        server.stop(None)
