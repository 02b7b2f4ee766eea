"""The service's credentials as its configuration gives them: the service token and the per-job tokens, read
from their files and checked. Plain data, below every layer that checks a request against them."""

from __future__ import annotations

import os
from pathlib import Path

from rematd.planner.messages import JOB_ID_RE

TOKEN_ENV = "REMATD_TOKEN"


def load_token(token_file: str | None) -> str | None:
    """The token from ``--token-file`` (first line) or else $REMATD_TOKEN; None when neither is set."""
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text(encoding="utf-8").strip().splitlines()[0].strip() if path.stat().st_size else ""
        except OSError as err:
            raise ValueError(f"token-file {token_file!r} cannot be read: {err.strerror}") from err
        if not token:
            raise ValueError(f"token-file {token_file!r} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def load_job_tokens(path: str) -> dict[str, str]:
    """``--job-tokens-file``: ``JOB TOKEN`` per line (``JOB`` may be a shell pattern such as ``team-a-*``;
    ``#`` starts a comment); ValueError naming the file and line when one is not that."""
    if not path:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"job-tokens-file {path!r} cannot be read: {err.strerror}") from err
    tokens: dict[str, str] = {}
    lines: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"job-tokens-file {path!r} line {n}"
        if len(words) != 2 or len(words[1]) < 16:
            raise ValueError(f"{where}: want 'JOB TOKEN' with a token of 16+ characters")
        job = words[0]
        problem = job_pattern_problem(job)
        if problem:
            raise ValueError(f"{where}: {job[:64]!r} {problem}")
        if job in lines:
            # Which line's token would hold is no one's guess to make: the operator says.
            raise ValueError(f"{where}: job {job!r} is given a token on line {lines[job]} already")
        tokens[job] = words[1]
        lines[job] = n
    return tokens


_PATTERN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-*?[]!")


def job_pattern_problem(job: str) -> str:
    """Why ``job`` names no job of a job-tokens file (a job name, or a shell pattern of job names), or ""."""
    if len(job) > 128:
        return "is longer than a job name (128 characters)"
    bad = sorted(set(job) - _PATTERN_CHARS)
    if bad:
        return f"has {''.join(bad)[:8]!r}, which no job name holds (letters, digits, '.', '_', '-'; '*', '?', '[...]')"
    depth = 0
    for c in job:
        if c == "[":
            if depth:
                return "opens a '[' inside another"
            depth = 1
        elif c == "]":
            if not depth:
                return "closes a ']' it did not open"
            depth = 0
    if depth:
        return "leaves a '[' open"
    if not any(c in job for c in "*?[") and not JOB_ID_RE.fullmatch(job):
        return "is not a job name (it must start with a letter or a digit)"
    return ""


def token_problem(token: str | None) -> str:
    """Why ``token`` cannot be the service token ("" when it can, or when there is none)."""
    if token is not None and (len(token) < 16 or any(c.isspace() for c in token)):
        return "token must be at least 16 characters with no whitespace"
    return ""
