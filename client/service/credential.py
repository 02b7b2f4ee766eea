"""The job credential this training process presents in its hellos (``Hello.job_secret``).

The service binds a rank to the credential of the process that opened it: while the rank can be
resumed, only that credential resumes it, so a stray process or a second job of the same name
cannot take it over or teach its planner what it did not measure. The credential is the per-job
token an operator issued (``$REMATD_JOB_TOKEN``), shared by the job's ranks; without one, a
secret made once per process, kept in its memory for as long as it trains and never logged.
"""

from __future__ import annotations

import os
import secrets

JOB_TOKEN_ENV = "REMATD_JOB_TOKEN"

_PROCESS_SECRET = secrets.token_urlsafe(24)


def job_credential() -> str:
    """The operator's job token when one is set, else this process's own secret."""
    return os.environ.get(JOB_TOKEN_ENV, "").strip() or _PROCESS_SECRET
