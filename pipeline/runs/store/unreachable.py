"""A tracking server that goes away (restarted, its node rebooted): every tracking call retries it for a bounded time
(`mlflow.retry_s`), then the job or driver stops with one line that says what happened and what to do.

MLflow's client retries each HTTP request itself, with exponential backoff, on a refused connection, a dropped one, a
timeout and a 429/5xx answer; `MLFLOW_HTTP_REQUEST_MAX_RETRIES` and `MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR` set how
often and how long (urllib3 waits 0, 2f, 4f, ... seconds between tries, at most 120 s apart; MLflow allows at most
10 retries and a factor of at most 120), read at every request. `bound_retries` chooses the two so that a request
gives up after about `retry_s` seconds of a server that does not answer, and sets them for this process and the
processes it starts (fold jobs, SLURM tasks); one try that hangs on a silent host adds up to its own timeout
(`MLFLOW_HTTP_REQUEST_TIMEOUT`, at most 120 s). Once a request has given up, `is_unreachable` tells that error from
any other, and `unreachable_line` says it in one line.
"""

from __future__ import annotations

import os

import requests

from pipeline.runs.store.tracking import redact_uri

MAX_RETRIES_ENV, BACKOFF_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
MAX_RETRIES, MAX_FACTOR, MAX_WAIT_S = 10, 120, 120  # MLflow's limits, and urllib3's longest wait between tries
EXIT_UNREACHABLE = 75  # EX_TEMPFAIL: try again later (the same command resumes)


class StoreUnreachable(ConnectionError):
    """A job found the tracking server gone for good (its retries spent): the launcher stops starting others, which
    would each wait as long."""


def retry_wait_s(retries: int, factor: int) -> int:
    """Seconds urllib3 waits in all between `retries` tries after the first, with backoff `factor` (no jitter)."""
    return sum(min(MAX_WAIT_S, factor * 2 ** (k - 1)) for k in range(2, retries + 1))


def retry_settings(retry_s: float) -> tuple[int, int, int]:
    """(retries, backoff factor, seconds waited in all): the fewest seconds that reach `retry_s`, in as many tries
    as give them (a server back in a moment is tried again soon); the most MLflow allows where none reach it."""
    choices = [(retry_wait_s(n, f), -n, f) for n in range(1, MAX_RETRIES + 1) for f in range(1, MAX_FACTOR + 1)]
    enough = [choice for choice in choices if choice[0] >= retry_s]
    waited, retries, factor = min(enough) if enough else max(choices)
    return -retries, factor, waited


def bound_retries(retry_s: float) -> int:
    """MLflow's retry variables set, in this process's environment (and so in every process it starts), to give up
    on a server that does not answer after about `retry_s` seconds; returns the seconds they wait in all."""
    retries, factor, waited = retry_settings(retry_s)
    os.environ[MAX_RETRIES_ENV], os.environ[BACKOFF_ENV] = str(retries), str(factor)
    os.environ[TIMEOUT_ENV] = str(int(min(MAX_WAIT_S, max(10, retry_s))))
    return waited


def is_unreachable(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a tracking server that did not answer at all: a connection refused,
    dropped or timed out, or 5xx answers, each retried until MLflow gave up. An answer the server did give (a
    missing run, a refused write) is not."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, StoreUnreachable | requests.exceptions.ConnectionError | requests.exceptions.Timeout
                      | requests.exceptions.RetryError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def unreachable_line(uri: str, what: str) -> str:
    """The one line said when the tracking server at `uri` stayed away: who stops, after how long, what to do."""
    waited = os.environ.get(MAX_RETRIES_ENV) and retry_wait_s(int(os.environ[MAX_RETRIES_ENV]),
                                                              int(os.environ.get(BACKOFF_ENV, "2")))
    after = f" for about {waited} s (mlflow.retry_s)" if waited else ""
    return (f"{what}: the tracking server {redact_uri(uri)} did not answer{after}; stopped. What finished is kept: "
            f"once the server answers again, the same command resumes")
