from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench import warm

if TYPE_CHECKING:
    from rematd.server import ServiceThread

# Small CPU models train faster on one thread, and parallel test workers share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the planner and server tests run without torch
    torch = None  # type: ignore[assignment]

# The tests start hundreds of ranks, torchtitan's and the stock models' among them: the fork they start from
# imports those libraries once a worker. DeepSpeed picks its accelerator as it is imported: its ranks here run
# on the CPU, as ``DS_ACCELERATOR`` says.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
warm.also_preload(*warm.LIBRARIES, *(("deepspeed",) if os.environ["DS_ACCELERATOR"] == "cpu" else ()))

ALLOW_CLIENT_ERRORS = "allow_client_errors"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ALLOW_CLIENT_ERRORS}(reason): the test provokes errors that rematd.client logs; they do not fail it",
    )


FIRST = (
    "test_torchtitan.py",
    "test_switches.py",
    "test_bench_deepspeed.py",
    "test_pipeline.py",
    "test_fsdp.py",
    "test_deepspeed.py",
    "test_torchtitan_pipeline.py",
)
"""Modules of multi-rank runs of a minute or more a test, run first: started last, one of them would keep one
worker busy for minutes after the other had run out of tests."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: k for k, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _client_errors_fail_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """The client swallows its errors so that training goes on; a test must not pass while it does."""
    collect = _Collect()
    logger = logging.getLogger("rematd.client")
    logger.addHandler(collect)
    try:
        yield
    finally:
        logger.removeHandler(collect)
    if collect.records and request.node.get_closest_marker(ALLOW_CLIENT_ERRORS) is None:
        lines = [
            f"{r.levelname} {r.getMessage()}" + (f" [{r.exc_info[1]!r}]" if r.exc_info else "") for r in collect.records
        ]
        pytest.fail(
            f"rematd.client logged {len(lines)} error(s); fix them, or mark the test "
            f"@pytest.mark.{ALLOW_CLIENT_ERRORS}(reason=...):\n" + "\n".join(lines),
            pytrace=False,
        )


@pytest.fixture
def service_thread(tmp_path: Path) -> Iterator[ServiceThread]:
    """A real service in this process, on loopback ports it picks itself, with a SQLite record in ``tmp_path``."""
    from rematd.server import ServeConfig, ServiceThread

    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    svc.start()
    yield svc
    svc.stop()
