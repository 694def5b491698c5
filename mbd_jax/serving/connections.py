"""Connection limits that uvicorn does not have: a cap on open connections and a header timeout.

uvicorn accepts every connection and waits forever for a request on it, so idle sockets can use
up the process's file descriptors (then every accept fails and logs a traceback). The protocol
here, a subclass of uvicorn's h11 protocol, closes a connection at once (after a 503) when
`max_connections` are open, and closes one that has not sent a complete request head within
`header_timeout_s` of connecting or of its last response. Idle keep-alive connections are closed
by uvicorn's own `timeout_keep_alive`; slow bodies by the service's body timeout.

`quiet_repeats` rate-limits repeated log lines (one per failed accept, one per malformed request)
so a flood cannot fill the disk.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("mbd_jax.serving")

_BODY = json.dumps({"error": {"message": "too many open connections; retry shortly",
                              "type": "unavailable", "param": None, "code": 503}}).encode()
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
           b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(_BODY)
           + _BODY)


def guarded_protocol(max_connections: int, header_timeout_s: float, metrics) -> type:
    """An h11 protocol class for uvicorn.Config(http=...) with the two limits."""

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _header_timer = None

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused = True
                metrics.connections_refused.inc()
                transport.write(REFUSED)
                transport.close()
                return
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # A response goes out as two writes (head, then body); with Nagle's algorithm
                # the body waits for the client's ACK of the head, which a kept-alive client
                # delays by ~40 ms: every request after a connection's first paid that. asyncio
                # turns Nagle off only for sockets made with proto IPPROTO_TCP; server.listen's
                # (and any inherited one) may have proto 0.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout,
                                                      self.cycle)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self, cycle_then) -> None:
            self._header_timer = None
            if self.cycle is cycle_then and not self.transport.is_closing():  # no new request
                metrics.connections_timed_out.inc()
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's head has the same limit
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


def connection_budget(ports: int, wanted: int, reserve: int = 128) -> int:
    """Raises the open-file limit as far as allowed and returns the per-port connection cap that
    fits it (`wanted`, or less with a warning), keeping `reserve` descriptors for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = ports * wanted + reserve
    if soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    cap = max(1, min(wanted, (soft - reserve) // ports))
    if cap < wanted:
        log.warning("server.max_connections %d does not fit the open-file limit %d; using %d per "
                    "port", wanted, soft, cap)
    return cap


class RepeatFilter(logging.Filter):
    """Lets through at most `burst` warnings or errors of the same (logger, level, message
    template) per `window_s` (the floods: a failed accept per connection, a malformed request per
    packet); the first one after a quiet window says how many were dropped. INFO and DEBUG lines
    all pass: one per event the service chose to log (a request, a warm-up step), each of which
    someone may need to find."""

    def __init__(self, burst: int = 5, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[tuple, list[float]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] > self.window_s:
            dropped = entry[2] if entry else 0
            if len(self._seen) > 10000:
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({int(dropped)} similar messages suppressed)"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


class FirstOnly(logging.Filter):
    """Drops every record of `template` after the first (uvicorn says "Started server process"
    once per port it serves)."""

    def __init__(self, template: str) -> None:
        super().__init__()
        self.template, self.seen = template, False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg) != self.template:
            return True
        seen, self.seen = self.seen, True
        return not seen


def quiet_repeats(logger_names=("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")) -> None:
    """Installs one RepeatFilter on every handler of these loggers, and one "started" line."""
    flt = RepeatFilter()
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatFilter) for f in handler.filters):
                handler.addFilter(flt)
    started = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, FirstOnly) for f in started.filters):
        started.addFilter(FirstOnly("Started server process [%d]"))
