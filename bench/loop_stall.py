"""How long the heaviest allowed messages hold a real ``rematd serve``'s event loop.

A stream sends the largest profile a hello may carry (4,096 blocks, every mode), then steps at
lengths it has not seen (each re-plans the table), then an OOM, while another client polls
/healthz back to back. The longest /healthz answer bounds how long any one message held the loop.

    python -m bench.loop_stall --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import httpx

from bench.served import served
from rematd import wire
from rematd.planner import Mode, ModeCost, Shape, Size
from rematd.planner.messages import MAX_BLOCKS, BlockProfile, Hello, StepStats
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

_T = TypeVar("_T")


def heaviest_hello(n: int = MAX_BLOCKS) -> Hello:
    blocks = tuple(
        BlockProfile(
            index=i,
            name=f"b{i}",
            saved_bytes=1000 + i % 7,
            input_bytes=100,
            forward_seconds=0.001,
            modes=(
                ModeCost(mode=Mode.STORE, kept=Size.linear(1000 + i % 7)),
                ModeCost(mode=Mode.SELECTIVE, kept=Size.linear(500 + i % 5), extra_seconds=0.0003),
                ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(100), transient=Size.linear(900), extra_seconds=0.001),
                ModeCost(mode=Mode.OFFLOAD, kept=Size.linear(50), extra_seconds=0.002),
            ),
        )
        for i in range(n)
    )
    shape = Shape(batch=1, seq_len=64, tokens=64)
    return Hello(job_id="heavy", blocks=blocks, profile_shape=shape, budget_bytes=n * 600)


def messages(steps: int, n: int = MAX_BLOCKS) -> list[pb.ClientMessage]:
    out = [pb.ClientMessage(hello=wire.hello_to_pb(heaviest_hello(n)))]
    for step in range(steps):
        seq = 16 + step * 97 % 2000
        stats = StepStats(
            step=step,
            saved_peak_bytes=n * 600 * (1 + step % 3) // 2,
            budget_bytes=n * 600,
            shape=Shape(batch=1, seq_len=seq, tokens=seq),
        )
        out.append(pb.ClientMessage(stats=wire.stats_to_pb(stats)))
    out.append(pb.ClientMessage(oom=pb.OomEvent(step=steps, shape=pb.Shape(batch=1, seq_len=1024, tokens=1024))))
    return out


def while_probing(http_base: str, send: Callable[[], _T]) -> tuple[_T, list[float]]:
    """What ``send`` returns, and the seconds each /healthz took, polled back to back while it ran."""
    lags: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=http_base, timeout=30) as http:
            while not stop.is_set():
                t = time.perf_counter()
                http.get("/healthz")
                lags.append(time.perf_counter() - t)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        return send(), lags
    finally:
        stop.set()
        prober.join()


def measure(grpc_target: str, http_base: str, steps: int) -> dict[str, float]:
    msgs = messages(steps)

    def stream() -> list[pb.ServerMessage]:
        with grpc.insecure_channel(grpc_target, options=[("grpc.max_send_message_length", 1 << 22)]) as ch:
            return list(pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=300))

    began = time.perf_counter()
    answers, lags = while_probing(http_base, stream)
    return {
        "messages": len(msgs),
        "answers": len(answers),
        "hello_bytes": msgs[0].ByteSize(),
        "stream_seconds": time.perf_counter() - began,
        "healthz_probes": len(lags),
        "healthz_max_ms": max(lags) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp(prefix="rematd-bench-")) / "r.db"
    with served(db) as srv:
        print(json.dumps(measure(srv.grpc, srv.http, args.steps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
