"""Each table the store writes, as the row type it keeps: its columns, and the statements that write
them, come from that type's fields, so a field is named once from the REST API to the SQL.

A table holds its row type's fields and the few columns only the database has (row ids, the owner a
read already knows, the process holding a rank). The tests hold each table in the database to its
definition here; a new field is a field of the row type and a migration (``schema``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rematd.server.store.rows import (
    JobRow,
    RankRow,
    StoredControlsRow,
    StoredOomRow,
    StoredPlanRow,
    StoredStepRow,
    WarmPlanRow,
    keys,
    nullable,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Table:
    """A table and the row type it keeps."""

    name: str
    row: type
    """The row type: one column per field, named as the field is."""
    owner: tuple[str, ...] = ()
    """Columns written but not read back as fields (the row's job, a rank's holder)."""
    key: tuple[str, ...] = ()
    """The conflict key of an upsert; none: rows are only inserted."""
    kept: tuple[str, ...] = ()
    """Columns an upsert leaves as they were on a row already there (a job's ``created_at``)."""

    columns: tuple[str, ...] = field(init=False)
    """The columns a write fills, in the order the fields are declared."""
    optional: frozenset[str] = field(init=False)
    """Columns a write may leave NULL: the fields that may hold None."""

    def __post_init__(self) -> None:
        # Computed once: the write-behind buffer asks for every row.
        object.__setattr__(self, "columns", (*self.owner, *keys(self.row)))
        object.__setattr__(self, "optional", nullable(self.row))

    def values(self, row: Mapping[str, object]) -> dict[str, object]:
        """A write's parameters from ``row`` (and the owner columns in it): every column, NULL for an optional
        one ``row`` leaves out; KeyError naming a required one it lacks."""
        return {c: row.get(c) if c in self.optional else row[c] for c in self.columns}

    def insert(self) -> str:
        """An INSERT of every column, each bound by its own name; an upsert on ``key`` where there is one."""
        sql = f"INSERT INTO {self.name} ({', '.join(self.columns)}) VALUES ({', '.join(':' + c for c in self.columns)})"
        if not self.key:
            return sql
        changed = [c for c in self.columns if c not in self.key and c not in self.kept]
        sets = ", ".join(f"{c}=excluded.{c}" for c in changed)
        return f"{sql} ON CONFLICT({', '.join(self.key)}) DO UPDATE SET {sets}"


STATS = Table(name="stats", row=StoredStepRow, owner=("job",))
OOM_EVENTS = Table(name="oom_events", row=StoredOomRow, owner=("job",))
PLANS = Table(name="plans", row=StoredPlanRow, owner=("job",))
JOBS = Table(name="jobs", row=JobRow, key=("job",), kept=("created_at",))
# A rank's last statistics are the write-behind buffer's to write, not a hello's.
RANKS = Table(name="ranks", row=RankRow, owner=("holder",), key=("job", "rank"), kept=("last_stats",))
JOB_CONTROLS = Table(name="job_controls", row=StoredControlsRow, key=("job",))
WARM_PLANS = Table(name="warm_plans", row=WarmPlanRow, key=("model_fingerprint", "device", "shape_bucket"))

TABLES = (STATS, OOM_EVENTS, PLANS, JOBS, RANKS, JOB_CONTROLS, WARM_PLANS)
"""Every table that keeps a row type (``schema_version``, ``holders``, ``learned_state`` and ``write_probe``
are the store's own bookkeeping)."""
