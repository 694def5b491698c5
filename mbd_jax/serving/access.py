"""The access log: one line per request, for audits. Its own logger (`mbd_jax.access`, always at
INFO whatever monitoring.log_level says, never under the repeated-line limit), in the service's
log or in monitoring.access_log_file (rotated like the main log). A line names the request id,
the key's name (never the key), the client address, the route, the status (499: the client went
away, also in the middle of a stream), the prompt and completion tokens, the milliseconds and
the bytes received; probes (/health, /ready, /metrics) at DEBUG.
"""

from __future__ import annotations

import logging
import logging.handlers

from starlette.requests import Request as HTTPRequest

from mbd_jax.config import MonitoringConfig
from mbd_jax.errors import UserError

log = logging.getLogger("mbd_jax.access")


def setup(m: MonitoringConfig) -> None:
    """Access lines at INFO, to monitoring.access_log_file when set (else the service's log)."""
    log.setLevel(logging.DEBUG if m.log_level == "debug" else logging.INFO)
    for handler in list(log.handlers):
        log.removeHandler(handler)
    log.propagate = not m.access_log_file
    if m.access_log_file:
        try:
            handler = logging.handlers.RotatingFileHandler(
                m.access_log_file, maxBytes=m.log_max_bytes, backupCount=m.log_backups)
        except OSError as e:
            raise UserError(f"monitoring.access_log_file {m.access_log_file}: {e.strerror}") \
                from None
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)


def tokens(request: HTTPRequest) -> tuple[int, int]:
    """(prompt, completion) tokens of the generations this HTTP request started."""
    jobs = getattr(request.state, "jobs", ())
    return sum(len(j.prompt) for j in jobs), sum(j.sent_tokens for j in jobs)


def line(request: HTTPRequest, path: str, status: int, ms: float, probe: bool) -> None:
    caller = getattr(request.state, "caller", None)
    prompt, completion = tokens(request)
    log.log(logging.DEBUG if probe else logging.INFO,
            "request %s key=%s client=%s %s %s status=%d prompt_tokens=%d completion_tokens=%d "
            "ms=%.1f bytes_in=%s", request.state.rid, caller.name if caller else "-",
            request.client.host if request.client else "-", request.method, path, status,
            prompt, completion, ms, request.headers.get("content-length", "-"))
