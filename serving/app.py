"""The HTTP layer (Starlette): OpenAI-compatible routes, /generate, health, and the admin app.

HTTP only: requests are validated here and handed to the Scheduler; nothing here touches a device
or blocks the event loop. Every client mistake is a 4xx with a JSON body
{"error": {"message", "type", "param"}} that names the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import pathlib
import re
import secrets
import threading
import time
import uuid
from typing import Any

import jax
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mbd_jax import chat
from mbd_jax.config import DecodeConfig, ServeConfig, from_dict
from mbd_jax.errors import UserError
from serving.body import BodyError, parse_object
from serving.scheduler import Draining, EngineDown, QueueFull, Request, Scheduler

log = logging.getLogger("mbd_jax.serving")

# OpenAI fields we accept only at their default (anything else is refused, not silently ignored).
_DEFAULT_ONLY = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": None,
                 "top_logprobs": None, "echo": False, "best_of": 1, "stop": None, "suffix": None,
                 "logit_bias": None, "response_format": None}
_STRING_FIELDS = ("model", "user")  # accepted, must be strings
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what an X-Request-Id may echo back
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
           "stream_options", "user", "decoding", "thinking", *_DEFAULT_ONLY}


def _shown(text: str, limit: int = 64) -> str:
    """A client-supplied name as error messages quote it: at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def engine_error(status: int, message: str) -> HTTPError:
    """The HTTPError for an ("error", status, message) event from the engine thread."""
    if status == 503:  # overload or shutdown: the client may retry
        return HTTPError(503, message, kind="unavailable", headers={"Retry-After": "1"})
    return HTTPError(status, message, kind="timeout" if status == 504 else "server_error")


def error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param,
                                   "code": e.status}}, status_code=e.status, headers=e.headers)


class TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._tokens: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    MAX_KEYS = 65536  # past this many callers, those with a full bucket are forgotten

    def take(self, key: str, consume: bool = True) -> float:
        """0 if allowed (taking a token unless `consume` is False), else seconds until a token
        is available."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._tokens.get(key, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1:
                if consume:
                    self._tokens[key] = (tokens - 1, now)
                    self._prune(now)
                return 0.0
            self._tokens[key] = (tokens, now)
            return (1 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        if len(self._tokens) > self.MAX_KEYS:
            self._tokens = {k: (t, last) for k, (t, last) in self._tokens.items()
                            if t + (now - last) * self.rate < self.burst}


@dataclasses.dataclass
class Service:
    """Everything the routes share."""

    cfg: ServeConfig
    scheduler: Scheduler
    metrics: Any
    model_name: str
    api_keys: list[str]
    profile_dir: pathlib.Path
    rate: TokenBucket | None = None
    auth_failures: TokenBucket | None = None  # wrong keys per client address
    profiling: bool = False

    def __post_init__(self):
        s = self.cfg.server
        if s.rate_limit_per_s > 0:
            self.rate = TokenBucket(s.rate_limit_per_s, s.rate_limit_burst)
        self.auth_failures = TokenBucket(s.auth_failures_per_min / 60, s.auth_failures_per_min)

    # ------------------------------------------------------------ request checks
    def authorize(self, request: HTTPRequest) -> str:
        """The caller's key (or client address when the service is open); 401 otherwise. Each
        configured key is compared in constant time."""
        address = request.client.host if request.client else "anonymous"
        if not self.api_keys:
            return address
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        # An address that guessed wrong too often is refused before its key is even compared.
        wait = self.auth_failures.take(address, consume=False)
        if wait > 0:
            self.metrics.rejected.labels("auth_failures").inc()
            raise HTTPError(429, f"too many invalid API keys from this address (at most "
                                 f"{self.cfg.server.auth_failures_per_min} a minute)",
                            kind="rate_limit_error", headers={"Retry-After": str(max(1, round(wait)))})
        match = None
        for key in self.api_keys:
            if hmac.compare_digest(given.encode(), key.encode()) and given:
                match = key
        if match is None:
            if given:  # a missing header is a misconfigured client, not a guess
                self.auth_failures.take(address)
            self.metrics.rejected.labels("auth").inc()
            raise HTTPError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                            kind="authentication_error",
                            headers={"WWW-Authenticate": 'Bearer realm="mbd-jax"'})
        return match

    def limit_rate(self, caller: str) -> None:
        if self.rate is None:
            return
        wait = self.rate.take(caller)
        if wait > 0:
            self.metrics.rate_limited.inc()
            self.metrics.rejected.labels("rate_limit").inc()
            raise HTTPError(429, f"rate limit: {self.cfg.server.rate_limit_per_s} requests/s "
                                 f"(burst {self.cfg.server.rate_limit_burst}) per key",
                            kind="rate_limit_error", headers={"Retry-After": str(max(1, round(wait)))})

    async def read_json(self, request: HTTPRequest) -> dict:
        limit = self.cfg.server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body is {declared} bytes; the limit is {limit}")
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")

        timeout = self.cfg.server.body_timeout_s
        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise HTTPError(408, f"the request body did not arrive within {timeout:g} s",
                            kind="timeout") from None
        try:
            return parse_object(bytes(body))
        except BodyError as e:
            raise HTTPError(400, str(e), param=e.param) from None

    # ------------------------------------------------------------ parameters
    def decode_config(self, body: dict, allowed: set[str]) -> tuple[DecodeConfig, bool]:
        """The request's DecodeConfig (server defaults + overrides) and its thinking flag."""
        for key, value in body.items():
            if key not in allowed:
                shown = _shown(key)
                raise HTTPError(400, f"unknown field '{shown}'; allowed: {', '.join(sorted(allowed))}",
                                param=shown)
            if key in _DEFAULT_ONLY and value != _DEFAULT_ONLY[key] and not (
                    key == "logprobs" and value is False):
                raise HTTPError(400, f"field '{key}' is not supported (only {_DEFAULT_ONLY[key]!r})",
                                param=key)
            if key in _STRING_FIELDS and value is not None and not isinstance(value, str):
                raise HTTPError(400, f"field '{key}' must be a string", param=key)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"model '{_shown(model)}' does not exist; this server serves "
                                 f"'{self.model_name}' (GET /v1/models)", param="model",
                            kind="not_found_error")
        gen = self.cfg.generation
        thinking = body.get("thinking", gen.thinking_mode)
        if not isinstance(thinking, bool):
            raise HTTPError(400, "field 'thinking' must be true or false", param="thinking")
        base = dataclasses.asdict(self.cfg.decoding)
        base["voting"] = self.cfg.decoding.voting and dataclasses.asdict(self.cfg.decoding.voting)
        if gen.diffusion_steps:
            base.update(policy="fixed_steps", steps_per_block=gen.diffusion_steps)
        limit = gen.thinking_max_new_tokens if thinking else gen.max_new_tokens_limit
        base["max_new_tokens"] = min(gen.max_new_tokens, limit)
        decoding = body.get("decoding", {})
        if decoding is None:
            decoding = {}
        if not isinstance(decoding, dict):
            raise HTTPError(400, "field 'decoding' must be an object", param="decoding")
        overrides = dict(decoding)
        for field, key in (("max_new_tokens", "max_tokens"), ("max_new_tokens", "max_completion_tokens"),
                           ("max_new_tokens", "max_new_tokens"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("seed", "seed")):
            if body.get(key) is not None:
                overrides[field] = body[key]
        requested = overrides.get("max_new_tokens")
        if isinstance(requested, int) and not isinstance(requested, bool) and requested > limit:
            raise HTTPError(400, f"max_tokens must be at most {limit} on this server"
                                 + (" for thinking requests" if thinking else ""), param="max_tokens")
        if "temperature" in overrides and isinstance(overrides["temperature"], (int, float)) \
                and overrides["temperature"] > 2:
            raise HTTPError(400, "field 'temperature' must be in [0, 2]", param="temperature")
        nfe = overrides.get("max_nfe")
        if isinstance(nfe, int) and not isinstance(nfe, bool) and nfe > gen.max_nfe_limit:
            raise HTTPError(400, f"field 'max_nfe' must be at most {gen.max_nfe_limit} on this "
                                 "server", param="max_nfe")
        if overrides.get("seed") is None:  # no seed: fresh randomness; a given seed replays
            overrides["seed"] = secrets.randbelow(2**31)
        base.update(overrides)
        try:
            d = from_dict(DecodeConfig, base, where="decoding")
            self.scheduler.engine.check_decode(d)
        except UserError as e:
            raise HTTPError(400, str(e), param=getattr(e, "field", None) or "decoding") from None
        return d, thinking

    def encode(self, text: Any, param: str) -> list[int]:
        if not isinstance(text, str):
            raise HTTPError(400, f"field '{param}' must be a string", param=param)
        if not text:
            raise HTTPError(400, f"field '{param}' is empty; give some text", param=param)
        ids = self.scheduler.engine.tokenizer.encode(text)
        try:
            self.scheduler.engine.check_prompt(ids, where=param)
        except UserError as e:
            raise HTTPError(400, str(e), param=param) from None
        return ids

    # ------------------------------------------------------------ running requests
    async def start(self, prompts: list[list[int]], decode: DecodeConfig, thinking: bool) -> list[Request]:
        if self.scheduler.error is not None:
            self.metrics.rejected.labels("engine_down").inc()
            raise HTTPError(503, "the engine has failed and the server is restarting",
                            kind="unavailable", headers={"Retry-After": "5"})
        if not self.scheduler.ready:
            self.metrics.rejected.labels("loading").inc()
            raise HTTPError(503, "the model is still loading; retry when /ready is 200",
                            kind="unavailable", headers={"Retry-After": "5"})
        loop = asyncio.get_running_loop()
        reqs = [Request(id=f"req-{uuid.uuid4().hex[:16]}", prompt=p, decode=decode, loop=loop,
                        thinking=thinking) for p in prompts]
        try:
            self.scheduler.submit(reqs)
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            raise HTTPError(429, f"the queue is full ({self.cfg.server.queue_size} waiting)",
                            kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except Draining:
            self.metrics.rejected.labels("draining").inc()
            raise HTTPError(503, "the server is shutting down", kind="unavailable",
                            headers={"Retry-After": "1"}) from None
        except EngineDown:
            self.metrics.rejected.labels("engine_down").inc()
            raise HTTPError(503, "the engine has failed and the server is restarting",
                            kind="unavailable", headers={"Retry-After": "5"}) from None
        return reqs

    @staticmethod
    async def collect(req: Request):
        """Waits for a request's result; raises HTTPError for an engine-side error."""
        while True:
            event = await req.events.get()
            if event[0] == "done":
                return event[1]
            if event[0] == "error":
                raise engine_error(event[1], event[2])


async def client_gone(request: HTTPRequest) -> None:
    """Returns once the client closed its connection (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: HTTPRequest, reqs: list[Request], work):
    """Awaits `work` (a coroutine); if the client disconnects first, cancels `reqs` (their rows
    are freed at the engine's next step) and raises ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(request))
    finished = False
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        result = task.result()
        finished = True
        return result
    finally:
        gone.cancel()
        task.cancel()  # no-op once done
        if not finished:  # gone, failed or cancelled: the rows are freed at the next step
            for r in reqs:
                r.cancelled = True


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids), "nfe": result.nfe,
            "tokens_per_forward": round(result.tpf, 4)}


def finish_reason(result) -> str:
    return {"stop": "stop", "length": "length", "max_nfe": "length"}.get(result.finish_reason, "stop")


def voting_info(result) -> dict:
    return {} if result.vote_scores is None else {
        "voting": {"answer": result.voted_answer, "final_answer": result.final_answer}}


def request_id(request: HTTPRequest) -> str:
    """The client's X-Request-Id when it is a plain token, else a fresh one (never echo control
    bytes or unbounded text into headers and logs)."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def build_apps(svc: Service) -> tuple[Starlette, Starlette]:
    """(data app, admin app)."""

    def route(path: str, methods: list[str], name: str):
        def wrap(handler):
            async def endpoint(request: HTTPRequest) -> Response:
                t0 = time.perf_counter()
                rid = request_id(request)
                try:
                    response = await handler(request)
                except HTTPError as e:
                    response = error_response(e)
                except ClientGone:  # nobody to answer; 499 is what the log and metrics say
                    response = Response(status_code=499)
                except Exception:  # a bug, not the client's fault: log it, say 500 without details
                    log.exception("request %s on %s failed", rid, path)
                    response = error_response(HTTPError(500, "internal error; see the server log",
                                                        kind="server_error"))
                response.headers["x-request-id"] = rid
                svc.metrics.requests.labels(name, str(response.status_code)).inc()
                log.info("request %s %s %s status=%d bytes_in=%s ms=%.1f", rid, request.method,
                         path, response.status_code, request.headers.get("content-length", "-"),
                         (time.perf_counter() - t0) * 1e3)
                return response
            return Route(path, endpoint, methods=methods, name=name)
        return wrap

    async def guarded(request: HTTPRequest) -> dict:
        caller = svc.authorize(request)
        svc.limit_rate(caller)
        return await svc.read_json(request)

    @route("/v1/completions", ["POST"], "completions")
    async def completions(request):
        body = await guarded(request)
        decode, thinking = svc.decode_config(body, _COMMON | {"prompt"})
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        ids = svc.encode(prompt, "prompt")
        return await respond(request, body, ids, decode, thinking, chat_format=False)

    @route("/v1/chat/completions", ["POST"], "chat_completions")
    async def chat_completions(request):
        body = await guarded(request)
        decode, thinking = svc.decode_config(body, _COMMON | {"messages"})
        try:
            text = chat.render(body.get("messages"), thinking,
                               svc.scheduler.engine.cfg.chat_template)
        except UserError as e:
            raise HTTPError(400, str(e), param="messages") from None
        return await respond(request, body, svc.encode(text, "messages"), decode, thinking,
                             chat_format=True)

    def stream_settings(body: dict) -> tuple[bool, bool]:
        """(stream, include_usage), checked before anything starts."""
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, "field 'stream' must be true or false", param="stream")
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise HTTPError(400, "field 'stream_options' must be an object with at most "
                                 "'include_usage'", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise HTTPError(400, "field 'stream_options.include_usage' must be true or false",
                            param="stream_options.include_usage")
        return stream, include_usage

    async def respond(request, body, ids, decode, thinking, chat_format: bool) -> Response:
        stream, include_usage = stream_settings(body)
        (req,) = await svc.start([ids], decode, thinking)
        created = int(time.time())
        kind = "chat.completion" if chat_format else "text_completion"
        if not stream:
            result = await unless_gone(request, [req], svc.collect(req))
            choice = {"index": 0, "finish_reason": finish_reason(result), **voting_info(result)}
            if chat_format:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice.update(text=result.text, logprobs=None)
            return JSONResponse({"id": req.id, "object": kind, "created": created,
                                 "model": svc.model_name, "choices": [choice],
                                 "usage": usage(result)})

        # The stream opens with the first committed block: a request refused while it waited
        # (queue timeout, shutdown, engine failure) gets a real status code, not an in-band error.
        first = await unless_gone(request, [req], req.events.get())
        if first[0] == "error":
            req.cancelled = True
            raise engine_error(first[1], first[2])

        def sse(choices: list[dict], **extra) -> str:
            obj = {"id": req.id, "object": kind + ".chunk" if chat_format else kind,
                   "created": created, "model": svc.model_name, "choices": choices, **extra}
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(delta_text: str | None, reason: str | None, extra: dict | None = None) -> str:
            if chat_format:
                delta = {} if delta_text is None else {"content": delta_text}
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": reason,
                          "logprobs": None}
            return sse([{**choice, **(extra or {})}])

        async def events():
            try:
                if chat_format:  # OpenAI streams open with the assistant role
                    yield sse([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None}])
                event = first
                while True:
                    if event[0] == "tokens":
                        yield chunk(event[2], None)
                    elif event[0] == "done":
                        result = event[1]
                        yield chunk(None if chat_format else "", finish_reason(result), voting_info(result))
                        if include_usage:
                            yield sse([], usage=usage(result))
                        break
                    else:  # after the stream started: a typed error event
                        e = engine_error(event[1], event[2])
                        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'code': e.status}})}\n\n"
                        break
                    event = await req.events.get()
                yield "data: [DONE]\n\n"
            finally:
                req.cancelled = True  # a client that went away frees its row at the next step

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @route("/generate", ["POST"], "generate")
    async def generate(request):
        body = await guarded(request)
        segments = body.get("segments")
        if not isinstance(segments, list) or not segments:
            raise HTTPError(400, "field 'segments' must be a non-empty list of strings", param="segments")
        if len(segments) > svc.cfg.server.max_segments:
            raise HTTPError(400, f"{len(segments)} segments; the limit is "
                                 f"{svc.cfg.server.max_segments}", param="segments")
        rest = {k: v for k, v in body.items() if k != "segments"}
        decode, thinking = svc.decode_config(rest, {"max_new_tokens", "temperature", "top_p", "seed",
                                                    "decoding", "thinking"})
        ids = [svc.encode(s, f"segments[{i}]") for i, s in enumerate(segments)]
        reqs = await svc.start(ids, decode, thinking)  # all segments batched together
        results = await unless_gone(request, reqs,
                                    asyncio.gather(*(svc.collect(r) for r in reqs)))
        return JSONResponse({"output": [r.text for r in results], "segments": [
            {"tokens": len(r.token_ids), "nfe": r.nfe, "tpf": round(r.tpf, 4),
             "bubble_forwards": r.bubble_forwards, "finish_reason": r.finish_reason,
             **voting_info(r)} for r in results]})

    def model_card() -> dict:
        return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "mbd-jax",
                "max_model_len": svc.scheduler.engine.cfg.max_seq_len}

    @route("/v1/models", ["GET"], "models")
    async def models(request):
        svc.authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @route("/v1/models/{model_id:path}", ["GET"], "model")
    async def model(request):
        svc.authorize(request)
        if request.path_params["model_id"] != svc.model_name:
            raise HTTPError(404, f"model '{_shown(request.path_params['model_id'])}' does not exist; "
                                 f"this server serves '{svc.model_name}'", param="model",
                            kind="not_found_error")
        return JSONResponse(model_card())

    @route("/health", ["GET"], "health")
    async def health(request):
        """200 while the process can serve (also while loading or draining); 503 once its engine
        has failed for good (the process is on its way out)."""
        if svc.scheduler.error is not None:
            raise HTTPError(503, "the engine has failed", kind="unavailable")
        return JSONResponse({"status": "ok"})

    @route("/ready", ["GET"], "ready")
    async def ready(request):
        if svc.scheduler.draining:
            raise HTTPError(503, "draining", kind="unavailable")
        if svc.scheduler.error is not None or not svc.scheduler.ready:
            raise HTTPError(503, "starting" if svc.scheduler.error is None else "engine failed",
                            kind="unavailable")
        return JSONResponse({"status": "ready"})

    handlers = {StarletteHTTPException: http_exception}
    data = Starlette(routes=[completions, chat_completions, generate, models, model, health,
                             ready],
                     exception_handlers=handlers)

    # ------------------------------------------------------------ admin
    @route("/metrics", ["GET"], "metrics")
    async def metrics(request):
        if not svc.cfg.monitoring.enabled:
            raise HTTPError(404, "monitoring is disabled")
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @route("/admin/profile", ["POST"], "profile")
    async def profile(request):
        body = await svc.read_json(request)
        seconds = body.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= 300:
            raise HTTPError(400, "field 'seconds' must be a number in (0, 300]", param="seconds")
        if svc.profiling:
            raise HTTPError(409, "a profile is already being captured", kind="conflict")
        svc.profiling = True
        out = svc.profile_dir / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        try:
            jax.profiler.start_trace(str(out))
            await asyncio.sleep(seconds)
        finally:
            jax.profiler.stop_trace()
            svc.profiling = False
        return JSONResponse({"directory": str(out.resolve()), "seconds": seconds})

    admin = Starlette(routes=[metrics, profile, health], exception_handlers=handlers)
    return data, admin


async def http_exception(request: HTTPRequest, exc: StarletteHTTPException) -> Response:
    """Unknown routes (404) and wrong methods (405) answer in the same JSON error shape."""
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(HTTPError(exc.status_code, message, kind="invalid_request_error",
                                    headers=dict(exc.headers or {})))
