"""Memory of a real ``rematd serve`` after rejected streams: RSS before and after N refused hellos.

Each stream sends one hello of about 0.9 MiB (4,096 blocks with long names) that the service
converts and then refuses (INVALID_ARGUMENT), the costliest kind of rejection. RSS is read from
/proc after a warm-up and after the N streams. ``--packed`` sends instead a 1 MiB hello packed with
size terms (some 237,000 sub-messages, which cost about 16 times their bytes once parsed), from
``--parallel`` threads at once; RSS is also read at its peak and after 10 s idle.

    python -m bench.rejected_streams --streams 1000
    python -m bench.rejected_streams --packed --parallel 8 --streams 160
    python -m bench.rejected_streams --burst      # 20 of each kind, one by one and 8 at once: RSS 3 s later
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.served import served
from rematd import wire
from rematd.planner import Shape
from rematd.planner.messages import BlockProfile, Hello
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

MiB = 2**20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def refused_hello(blocks: int = 4096) -> pb.ClientMessage:
    """A hello of about 0.9 MiB that converts in full before it is refused (its budget is 0)."""
    hello = Hello(
        job_id="refused",
        blocks=tuple(
            BlockProfile(index=i, name="n" * 200, saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
            for i in range(blocks)
        ),
        profile_shape=Shape(batch=1, seq_len=64, tokens=64),
        budget_bytes=1,
    )
    msg = wire.hello_to_pb(hello)
    msg.budget_bytes = 0
    return pb.ClientMessage(hello=msg)


def packed_hello(blocks: int = 1850) -> pb.ClientMessage:
    """A hello just under 1 MiB whose blocks carry every mode, each with 16 kept and 16 transient size terms."""
    h = pb.Hello(job_id="refused", world_size=1, budget_bytes=0, profile_shape=pb.Shape(batch=1, seq_len=64, tokens=64))
    for i in range(blocks):
        b = h.blocks.add(index=i, name="b", saved_bytes=1, input_bytes=1, forward_seconds=0.01)
        for mode in (pb.MODE_STORE, pb.MODE_SELECTIVE, pb.MODE_RECOMPUTE, pb.MODE_OFFLOAD):
            cost = b.modes.add(mode=mode)
            for _ in range(16):
                cost.kept.add(bytes=1)
                cost.transient.add(bytes=1)
    return pb.ClientMessage(hello=h)


def measure_parallel(target: str, pid: int, streams: int, parallel: int) -> dict[str, float]:
    """RSS at start, at its peak while ``parallel`` threads send ``streams`` packed hellos in all, and 10 s after."""
    msg = packed_hello()
    start = peak = rss_bytes(pid)
    threads = [threading.Thread(target=send_refused, args=(target, msg, streams // parallel)) for _ in range(parallel)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - began
    time.sleep(10)
    idle = rss_bytes(pid)
    return {
        "streams": streams // parallel * parallel,
        "parallel": parallel,
        "message_bytes": msg.ByteSize(),
        "rss_start_mib": start / MiB,
        "rss_peak_mib": peak / MiB,
        "rss_after_10s_idle_mib": idle / MiB,
        "seconds": seconds,
    }


REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)


def send_refused(target: str, msg: pb.ClientMessage, n: int) -> None:
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.AdvisorStub(ch)
        for _ in range(n):
            try:
                list(stub.Session(iter([msg]), timeout=30))
            except grpc.RpcError as err:
                if err.code() not in REFUSALS:
                    raise
            else:
                raise RuntimeError("the hello was accepted")


def settled_rss(pid: int, seconds: float = 2.0) -> int:
    """The least RSS of ``pid`` over ``seconds`` after a burst of streams: the service collects their garbage
    soon after they end, not at once, and later on a busy machine. What stays is what the streams kept."""
    least = rss_bytes(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.25)
        least = min(least, rss_bytes(pid))
    return least


def measure(target: str, pid: int, streams: int, warmup: int = 10) -> dict[str, float]:
    msg = refused_hello()
    start = rss_bytes(pid)
    send_refused(target, msg, warmup)
    warm = settled_rss(pid)
    began = time.perf_counter()
    send_refused(target, msg, streams)
    seconds = time.perf_counter() - began
    end = settled_rss(pid)
    return {
        "streams": streams,
        "message_bytes": msg.ByteSize(),
        "rss_start_mib": start / MiB,
        "rss_after_warmup_mib": warm / MiB,
        "rss_end_mib": end / MiB,
        "growth_from_start_mib": (end - start) / MiB,
        "growth_per_stream_kib": (end - warm) / streams / 1024,
        "seconds": seconds,
    }


def burst(target: str, pid: int, msg: pb.ClientMessage, streams: int, parallel: int, idle: float) -> dict[str, float]:
    """RSS idle, at its peak while ``streams`` copies of ``msg`` are refused (``parallel`` at once), and after."""
    time.sleep(idle)
    start = peak = rss_bytes(pid)
    share = [streams // parallel + (1 if i < streams % parallel else 0) for i in range(parallel)]
    threads = [threading.Thread(target=send_refused, args=(target, msg, n)) for n in share if n]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.02)
    time.sleep(idle)
    after = rss_bytes(pid)
    return {
        "streams": streams,
        "at_once": parallel,
        "message_mib": round(msg.ByteSize() / MiB, 2),
        "rss_idle_mib": round(start / MiB, 1),
        "rss_peak_mib": round(peak / MiB, 1),
        f"rss_{idle:g}s_after_mib": round(after / MiB, 1),
        "growth_mib": round((after - start) / MiB, 1),
    }


BURST_TOKEN = "rejected-streams-bench-token-0123456789"


def bursts(idle: float = 3.0) -> dict[str, dict[str, float]]:
    """20 hellos of each kind, one by one and 8 at once, each case on a fresh service: converted then refused
    (INVALID_ARGUMENT), packed with size terms (refused before conversion), and sent without the token a
    service requires (UNAUTHENTICATED)."""
    out = {}
    kinds = (("converted", refused_hello(), None), ("packed", packed_hello(), None))
    kinds += (("no token", refused_hello(), {"REMATD_TOKEN": BURST_TOKEN}),)
    for kind, msg, env in kinds:
        for parallel in (1, 8):
            db = Path(tempfile.mkdtemp(prefix="rematd-bench-")) / "r.db"
            with served(db, "--log-level", "warning", env=env) as srv:
                out[f"{kind}, {parallel} at once"] = burst(srv.grpc, srv.proc.pid, msg, 20, parallel, idle)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--packed", action="store_true", help="hellos packed with size terms, sent in parallel")
    parser.add_argument("--parallel", type=int, default=8, help="threads sending packed hellos at once")
    parser.add_argument("--burst", action="store_true", help="20 hellos of each kind, one by one and 8 at once")
    args = parser.parse_args()
    if args.burst:
        print(json.dumps(bursts(), indent=2))
        return 0
    db = Path(tempfile.mkdtemp(prefix="rematd-bench-")) / "r.db"
    with served(db) as srv:
        if args.packed:
            result = measure_parallel(srv.grpc, srv.proc.pid, args.streams, args.parallel)
        else:
            result = measure(srv.grpc, srv.proc.pid, args.streams)
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
