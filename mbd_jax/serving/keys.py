"""API keys and what each may do: a name (what the access log and errors say; never the key),
the routes it may call, whether it may use the admin routes, its own request rate and its token
budget per minute.

A key file is either a plain list (one key per line, `#` comments; each such key may call every
route, the admin ones too, and is named `key-` plus the first 8 hex digits of its SHA-256,
stable and safe to log) or a YAML list of mappings:

    - name: alice                  # required, unique
      key: sk-alice-0123456789     # required, unique, at least 16 characters
      routes: [chat_completions]   # route names it may call (default: every data route)
      admin: false                 # may call /admin/* (default false)
      requests_per_s: 2            # its own request rate (default: server.rate_limit_per_s)
      tokens_per_min: 20000        # prompt + completion tokens a minute (default 0: no budget)

`--api-key` and MBD_API_KEYS give plain keys. With no key at all the service is open.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import pathlib
import threading
import time

import yaml

from mbd_jax.config import ServerConfig
from mbd_jax.config.fields import _check, from_dict
from mbd_jax.errors import ConfigError, UserError

# The routes a key may be scoped to (routes.py names them so); the probes and /openapi.json are
# open to anyone who may call the service at all.
DATA_ROUTES = ("completions", "chat_completions", "generate", "models", "model")
MIN_KEY_CHARS = 16


@dataclasses.dataclass(frozen=True)
class ApiKey:
    name: str
    key: str
    routes: tuple[str, ...] = DATA_ROUTES
    admin: bool = False
    requests_per_s: float | None = None  # None: server.rate_limit_per_s
    tokens_per_min: int = 0  # 0: no token budget

    def validate(self, where: str) -> None:
        _check(bool(self.name.strip()), where, "field 'name' must not be empty")
        _check(len(self.key) >= MIN_KEY_CHARS, where,
               f"field 'key' must have at least {MIN_KEY_CHARS} characters")
        unknown = sorted(set(self.routes) - set(DATA_ROUTES))
        _check(not unknown, where, f"field 'routes': unknown route {unknown[:1]}; allowed: "
                                   f"{', '.join(DATA_ROUTES)}")
        _check(self.requests_per_s is None or self.requests_per_s > 0, where,
               "field 'requests_per_s' must be > 0 (leave it out for the server's rate)")
        _check(self.tokens_per_min >= 0, where, "field 'tokens_per_min' must be >= 0")

    def may_call(self, route: str) -> bool:
        return route in self.routes

    def __repr__(self) -> str:  # never the key itself, in a log or a traceback
        return f"ApiKey(name={self.name!r})"


def plain(key: str) -> ApiKey:
    """A key given bare: every route (the admin ones too), the server's rate, no budget."""
    return ApiKey(name="key-" + hashlib.sha256(key.encode()).hexdigest()[:8], key=key, admin=True)


def load_key_file(path: str | pathlib.Path) -> list[ApiKey]:
    """The keys of a key file (plain lines or named YAML records; module docstring)."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise UserError(f"--api-key-file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        return [plain(k.strip()) for k in text.splitlines()
                if k.strip() and not k.lstrip().startswith("#")]
    keys = []
    for i, entry in enumerate(data):
        where = f"{path}: key {i + 1}"
        if isinstance(entry.get("routes"), list):
            entry = {**entry, "routes": tuple(entry["routes"])}
        key = from_dict(ApiKey, entry, where=where)
        key.validate(where)
        keys.append(key)
    return keys


def check_unique(keys: list[ApiKey]) -> None:
    """Every name and every key once (a key file and MBD_API_KEYS may overlap by mistake)."""
    for field in ("name", "key"):
        seen: set[str] = set()
        for k in keys:
            value = getattr(k, field)
            if value in seen:
                shown = f"'{value}'" if field == "name" else f"of key '{k.name}'"
                raise ConfigError(f"API keys: the {field} {shown} is given twice")
            seen.add(value)


def find(keys: list[ApiKey], given: str) -> ApiKey | None:
    """The key `given` is, compared in constant time against every configured key."""
    match = None
    for k in keys:
        if given and hmac.compare_digest(given.encode(), k.key.encode()):
            match = k
    return match


class TokenBucket:
    """Per-caller buckets of `burst` tokens refilled at `rate` a second."""

    MAX_KEYS = 65536  # past this many callers, those with a full bucket are forgotten

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self._tokens: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, consume: bool = True) -> float:
        """0 if allowed (taking a token unless `consume` is False), else seconds until a token
        is available."""
        now = time.monotonic()
        with self._lock:
            tokens = self._level(key, now)
            if tokens >= 1:
                if consume:
                    self._tokens[key] = (tokens - 1, now)
                    self._prune(now)
                return 0.0
            self._tokens[key] = (tokens, now)
            return (1 - tokens) / self.rate

    def charge(self, key: str, amount: float) -> None:
        """Takes `amount` tokens, into debt if need be (a budget charged after the fact)."""
        now = time.monotonic()
        with self._lock:
            self._tokens[key] = (self._level(key, now) - amount, now)

    def _level(self, key: str, now: float) -> float:
        tokens, last = self._tokens.get(key, (float(self.burst), now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def _prune(self, now: float) -> None:
        if len(self._tokens) > self.MAX_KEYS:
            self._tokens = {k: (t, last) for k, (t, last) in self._tokens.items()
                            if t + (now - last) * self.rate < self.burst}


@dataclasses.dataclass
class Refused(Exception):
    """A request the gate refuses: its HTTP status, message, metrics reason, headers."""

    status: int
    message: str
    reason: str  # the mbd_requests_rejected label
    kind: str
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Caller:
    key: ApiKey | None  # None: the service is open
    id: str  # the key's name, or the client address of an open service

    @property
    def name(self) -> str:
        """What the access log says: the key's name, '-' on an open service."""
        return self.key.name if self.key else "-"


class Gate:
    """Who may call what, and how much: a request's key (or, open, its address), the key's
    routes and admin right, its request rate (the key's own or server.rate_limit_per_s) and its
    token budget a minute (charged with each request's prompt and completion tokens as it ends;
    a key in debt waits). Wrong keys are limited per client address."""

    def __init__(self, keys: list[ApiKey], server: ServerConfig):
        check_unique(keys)
        self.keys, self.server = keys, server
        per_min = server.auth_failures_per_min
        self.auth_failures = TokenBucket(per_min / 60, per_min)
        self._rates: dict[float, TokenBucket] = {}  # one per distinct rate
        self._budgets = {k.name: TokenBucket(k.tokens_per_min / 60, k.tokens_per_min)
                         for k in keys if k.tokens_per_min}

    def authorize(self, header: str, address: str, route: str, admin: bool = False) -> Caller:
        """The caller of a request with this Authorization header from `address`, allowed to
        call `route` (an admin route: `admin`), or Refused (401, 403, 429)."""
        if not self.keys:
            return Caller(None, address)
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        # An address that guessed wrong too often is refused before its key is even compared.
        wait = self.auth_failures.take(address, consume=False)
        if wait > 0:
            raise Refused(429, f"too many invalid API keys from this address (at most "
                               f"{self.server.auth_failures_per_min} a minute)", "auth_failures",
                          "rate_limit_error", {"Retry-After": str(max(1, round(wait)))})
        key = find(self.keys, given)
        if key is None:
            if given:  # a missing header is a misconfigured client, not a guess
                self.auth_failures.take(address)
            raise Refused(401, "missing or invalid API key (Authorization: Bearer KEY)", "auth",
                          "authentication_error", {"WWW-Authenticate": 'Bearer realm="mbd-jax"'})
        if admin and not key.admin:
            raise Refused(403, f"API key '{key.name}' may not call the admin route {route}",
                          "scope", "permission_error")
        if not admin and not key.may_call(route):
            raise Refused(403, f"API key '{key.name}' may not call {route}; it may call "
                               f"{', '.join(key.routes) or 'no data route'}", "scope",
                          "permission_error")
        return Caller(key, key.name)

    def admit(self, caller: Caller) -> None:
        """Takes a request from the caller's rate and checks its token budget (Refused: 429,
        the message naming which limit)."""
        rate = caller.key.requests_per_s if caller.key and caller.key.requests_per_s else \
            self.server.rate_limit_per_s
        if rate > 0:
            bucket = self._rates.get(rate)
            if bucket is None:  # one bucket per distinct rate, made once
                bucket = self._rates[rate] = TokenBucket(rate, self.server.rate_limit_burst)
            wait = bucket.take(caller.id)
            if wait > 0:
                whose = f"key '{caller.id}'" if caller.key else "this client"
                raise Refused(429, f"rate limit: {rate:g} requests/s (burst "
                                   f"{self.server.rate_limit_burst}) for {whose}", "rate_limit",
                              "rate_limit_error", {"Retry-After": str(max(1, round(wait)))})
        budget = self._budgets.get(caller.id) if caller.key else None
        if budget is not None:
            wait = budget.take(caller.id, consume=False)
            if wait > 0:
                raise Refused(429, f"token budget: {caller.key.tokens_per_min} prompt and "
                                   f"completion tokens a minute for key '{caller.id}', spent",
                              "token_budget", "rate_limit_error",
                              {"Retry-After": str(max(1, round(wait)))})

    def charge(self, caller: Caller | None, tokens: int) -> None:
        """A finished request's prompt and completion tokens, from its key's budget."""
        budget = self._budgets.get(caller.id) if caller and caller.key else None
        if budget is not None and tokens:
            budget.charge(caller.id, tokens)
