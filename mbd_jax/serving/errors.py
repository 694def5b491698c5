"""The error a route answers with: status, message, the request field it names (`param`), the
OpenAI error type and extra headers."""

from __future__ import annotations


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}
