"""Rows written into a store's SQLite file directly, as another process would: a long run's worth in a second.

Standard library only, so that a child process (a test's, a benchmark's) imports it at once.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path


def more_steps(db: Path, job: str, rows: int) -> None:
    """``rows`` more steps of ``job``, written into its table directly (a long run's worth, in a second)."""
    con = sqlite3.connect(db)
    try:
        columns = [r[1] for r in con.execute("PRAGMA table_info(stats)") if r[1] != "id"]
        first = con.execute(f"SELECT {', '.join(columns)} FROM stats WHERE job=?", (job,)).fetchone()
        at = columns.index("step")
        con.executemany(
            f"INSERT INTO stats ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            [(*first[:at], i + 1, *first[at + 1 :]) for i in range(rows)],
        )
        con.commit()
    finally:
        con.close()


def more_plans(db: Path, job: str, blocks: int, rows: int) -> None:
    """``rows`` more plans of ``job`` (of ``blocks`` blocks), each with a per-length table: large answers."""
    con = sqlite3.connect(db)
    try:
        columns = [r[1] for r in con.execute("PRAGMA table_info(plans)") if r[1] != "id"]
        first = dict(
            zip(
                columns,
                con.execute(f"SELECT {', '.join(columns)} FROM plans WHERE job=?", (job,)).fetchone(),
                strict=True,
            )
        )
        entry = {"max_tokens": 64, "modes": "R" * blocks, "predicted_peak_bytes": 1, "predicted_overhead_ratio": 0.5}
        table = json.dumps([{"max_seq_len": 64 * (k + 1), **entry} for k in range(16)])
        plans = [{**first, "version": v + 2, "modes": "R" * blocks, "shape_plans": table} for v in range(rows)]
        con.executemany(
            f"INSERT INTO plans ({', '.join(columns)}) VALUES ({', '.join(':' + c for c in columns)})", plans
        )
        con.commit()
    finally:
        con.close()
