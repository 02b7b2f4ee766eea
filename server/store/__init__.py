"""The store: jobs, plans, step statistics and OOM events in SQLite or PostgreSQL.

Schema and migrations, reads, writes, the write-behind buffer and compaction."""
