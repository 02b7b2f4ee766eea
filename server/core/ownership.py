"""Who may open, resume and report for a (job, rank): the process that opened it, proven by credentials.

First come, first served: the first hello of a rank binds it to the job credential it presents
(``Hello.job_secret``: a secret the client library creates once per training process, or a per-job
token an operator issued). While the rank can be resumed (its stream live, or lost less than
``--session-expiry-seconds`` ago without a goodbye), only a hello with that credential may resume
it, and one for a live stream must also present that stream's session secret. Every other hello is
refused (``ABORTED``) with the holder named (host, process id, model, since when), so the refused
process's log says who holds the rank. Job name, rank and fingerprint can be read over REST and
prove nothing; a stranger's hello for a rank whose trainer is away would otherwise have opened a
session there and taught its planner fake OOMs that the returning trainer inherited.

With ``--job-tokens-file``, a job it names is opened only with the token issued for it.
"""

from __future__ import annotations

import fnmatch
import hmac
import time
from collections.abc import Mapping

from rematd.planner.messages import Hello
from rematd.server.core.errors import SessionTaken, Unauthenticated
from rematd.server.core.sessions import RankSession


def same_secret(given: str, issued: str) -> bool:
    """Whether ``given`` is the non-empty secret ``issued``, compared in constant time."""
    return bool(given) and hmac.compare_digest(given.encode(), issued.encode())


def _same_credential(given: str, bound: str) -> bool:
    # A rank opened without a credential (a client older than credentials) is bound to none.
    return hmac.compare_digest(given.encode(), bound.encode())


def holder(session: RankSession) -> str:
    """Who holds a rank, as the refused process's log shows it."""
    h = session.hello
    where = f"process {h.pid or '?'} on {h.host or 'an unnamed host'}"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(session.opened_at))
    model = (h.model_fingerprint or "unnamed")[:16]
    return f"{where} (model {model}) since {since}"


def check_claim(existing: RankSession | None, hello: Hello, expiry_seconds: float) -> bool:
    """Whether ``hello`` is the holder's own (it presents the holder's job credential and the session
    secret of its stream); raises SessionTaken, naming the holder, when the rank is held by another."""
    if existing is None:
        return False
    credential = _same_credential(hello.job_secret, existing.hello.job_secret)
    owner = same_secret(hello.session_secret, existing.secret) and credential
    rank = f"rank {hello.rank} of job {hello.job_id!r}"
    if existing.streams > 0 and not owner:
        # Both, not either: the session secret alone (read off a log, a core dump) took a live rank over
        # and ended its trainer's stream with a step out of order.
        raise SessionTaken(
            f"{rank} is held by {holder(existing)}, live on another stream; a reconnect must present that "
            "process's job credential and the session secret from that stream's first acknowledgement (retry "
            "once it has ended)"
        )
    resumable = existing.streams == 0 and not existing.ended
    if resumable and not credential:
        raise SessionTaken(
            f"{rank} is held by {holder(existing)}, whose stream was lost; only that process (its job "
            f"credential) may resume it until it says goodbye or {expiry_seconds:.0f} s after its stream went"
        )
    return owner


class JobTokens:
    """Per-job tokens an operator issued: a job a line names (or a pattern matches) opens only with its token."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self.exact = {k: v for k, v in (tokens or {}).items() if not any(c in k for c in "*?[")}
        self.patterns = [(k, v) for k, v in (tokens or {}).items() if k not in self.exact]

    def token_for(self, job: str) -> str | None:
        if job in self.exact:
            return self.exact[job]
        return next((v for k, v in self.patterns if fnmatch.fnmatchcase(job, k)), None)

    def check(self, hello: Hello) -> None:
        """Raise Unauthenticated unless the job needs no token of its own or ``hello`` presents it."""
        token = self.token_for(hello.job_id)
        if token is not None and not same_secret(hello.job_secret, token):
            raise Unauthenticated(
                f"job {hello.job_id!r} needs the job token its operator issued (REMATD_JOB_TOKEN in the trainer)"
            )
