"""Memory of a real ``rematd serve`` after rejected streams: RSS before and after N refused hellos.

Each stream sends one hello of about 0.9 MiB (4,096 blocks with long names) that the service
converts and then refuses (INVALID_ARGUMENT), the costliest kind of rejection. RSS is read from
/proc after a warm-up and after the N streams.

    python -m bench.rejected_streams --streams 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.served import served
from rematd import wire
from rematd.planner import Shape
from rematd.records import BlockRecord, Hello
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
            BlockRecord(index=i, name="n" * 200, saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
            for i in range(blocks)
        ),
        profile_shape=Shape(batch=1, seq_len=64, tokens=64),
        budget_bytes=1,
    )
    msg = wire.hello_to_pb(hello)
    msg.budget_bytes = 0
    return pb.ClientMessage(hello=msg)


def send_refused(target: str, msg: pb.ClientMessage, n: int) -> None:
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.AdvisorStub(ch)
        for _ in range(n):
            try:
                list(stub.Session(iter([msg]), timeout=30))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
            else:
                raise RuntimeError("the hello was accepted")


def measure(target: str, pid: int, streams: int, warmup: int = 10) -> dict[str, float]:
    msg = refused_hello()
    start = rss_bytes(pid)
    send_refused(target, msg, warmup)
    warm = rss_bytes(pid)
    began = time.perf_counter()
    send_refused(target, msg, streams)
    seconds = time.perf_counter() - began
    time.sleep(0.5)  # the service collects soon after streams end, not at once
    end = rss_bytes(pid)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp(prefix="rematd-bench-")) / "r.db"
    with served(db) as srv:
        print(json.dumps(measure(srv.grpc, srv.proc.pid, args.streams), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
