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
from mbd_jax.stop_strings import StopStrings
from mbd_jax.serving import protocol
from mbd_jax.serving.body import BodyError, parse_object
from mbd_jax.serving.openai_response import Choices, voting_info
from mbd_jax.serving.request import Request
from mbd_jax.serving.scheduler import Draining, EngineDown, QueueFull, Scheduler

log = logging.getLogger("mbd_jax.serving")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what an X-Request-Id may echo back
OPENAPI = protocol.openapi("mbd-jax", "0.1.0")


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
    template: chat.Template  # the model's chat template
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
    def parse(self, model: type, body: dict, request: HTTPRequest) -> Any:
        """The body as a typed request (protocol.py): 400 naming the field otherwise; 404 for a
        model this server does not serve. Harmless fields that were set are logged."""
        try:
            req = protocol.parse(model, body)
        except protocol.RequestError as e:
            raise HTTPError(400, e.message, param=e.param) from None
        name = getattr(req, "model", None)
        if name is not None and name != self.model_name:
            raise HTTPError(404, f"model '{_shown(name)}' does not exist; this server serves "
                                 f"'{self.model_name}' (GET /v1/models)", param="model",
                            kind="not_found_error")
        ignored = [f for f in protocol.ignored(req)  # a Jinja template receives these
                   if not (self.template.jinja and f.startswith("chat_template_kwargs."))]
        if ignored:
            log.warning("request %s: ignoring %s (no effect on this server)",
                        getattr(request.state, "rid", "-"), ", ".join(ignored))
        return req

    def thinking(self, req: Any) -> bool:
        """`thinking`, else chat_template_kwargs.enable_thinking, else the server default."""
        kwargs = getattr(req, "chat_template_kwargs", None)
        for value in (req.thinking, kwargs and kwargs.enable_thinking):
            if value is not None:
                return value
        return self.cfg.generation.thinking_mode

    def decode_configs(self, req: Any, thinking: bool, count: int,
                       max_field: str) -> tuple[list[DecodeConfig], str | None]:
        """`count` DecodeConfigs (server defaults + the request's settings), one per choice, and
        the field that set the token budget (None: the server default). Choice j of a seeded request uses seed + j;
        an unseeded request gets fresh randomness per choice."""
        gen = self.cfg.generation
        base = dataclasses.asdict(self.cfg.decoding)
        base["voting"] = self.cfg.decoding.voting and dataclasses.asdict(self.cfg.decoding.voting)
        if gen.diffusion_steps:
            base.update(policy="fixed_steps", steps_per_block=gen.diffusion_steps)
        limit = gen.thinking_max_new_tokens if thinking else gen.max_new_tokens_limit
        base["max_new_tokens"] = min(gen.max_new_tokens, limit)
        overrides = dict(req.decoding or {})
        budget = getattr(req, max_field)
        if max_field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            max_field, budget = "max_completion_tokens", req.max_completion_tokens
        if budget is not None:
            overrides["max_new_tokens"] = budget
        elif "max_new_tokens" in overrides:
            max_field = "decoding.max_new_tokens"
        requested = overrides.get("max_new_tokens")
        if protocol.is_int(requested) and requested > limit:
            raise HTTPError(400, f"{max_field} must be at most {limit} on this server"
                                 + (" for thinking requests" if thinking else ""), param=max_field)
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                overrides[name] = getattr(req, name)
        if req.top_k is not None:
            overrides["top_k"] = max(req.top_k, 0)  # -1 and 0 both mean no limit
        nfe = overrides.get("max_nfe")
        if protocol.is_int(nfe) and nfe > gen.max_nfe_limit:
            raise HTTPError(400, f"field 'max_nfe' must be at most {gen.max_nfe_limit} on this "
                                 "server", param="decoding.max_nfe")
        if req.seed is not None:
            overrides["seed"] = req.seed % 2**31
        seeded = overrides.get("seed") is not None
        if not seeded:
            overrides["seed"] = 0  # replaced per choice below
        base.update(overrides)
        try:
            d = from_dict(DecodeConfig, base, where="decoding")
            self.scheduler.engine.check_decode(d)
        except UserError as e:
            field = getattr(e, "field", None)
            raise HTTPError(400, str(e), param=f"decoding.{field}" if field else "decoding") from None
        seeds = ([(d.seed + j) % 2**31 for j in range(count)] if seeded
                 else [secrets.randbelow(2**31) for _ in range(count)])
        return [dataclasses.replace(d, seed=s) for s in seeds], max_field if budget is not None else None

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        """Prompt text or token ids -> checked token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise HTTPError(400, f"field '{param}' is empty; give some text", param=param)
            ids = self.scheduler.engine.tokenizer.encode(prompt)
        else:
            ids = prompt
        try:
            self.scheduler.engine.check_prompt(ids, where=param)
        except UserError as e:
            raise HTTPError(400, str(e), param=param) from None
        return ids

    def check_room(self, ids: list[int], decode: DecodeConfig, param: str, budget_param: str) -> None:
        """A prompt plus an explicit token budget must fit the context (an implicit one is cut)."""
        context = self.scheduler.engine.cfg.max_seq_len
        if len(ids) + decode.max_new_tokens > context:
            raise HTTPError(400, f"{param} has {len(ids)} tokens and {budget_param} is "
                                 f"{decode.max_new_tokens}: together {len(ids) + decode.max_new_tokens}"
                                 f", more than the model's context of {context} tokens",
                            param=budget_param)

    # ------------------------------------------------------------ running requests
    def available(self) -> None:
        """503 while the model loads or after the engine failed."""
        if self.scheduler.error is not None:
            self.metrics.rejected.labels("engine_down").inc()
            raise HTTPError(503, "the engine has failed and the server is restarting",
                            kind="unavailable", headers={"Retry-After": "5"})
        if not self.scheduler.ready:
            self.metrics.rejected.labels("loading").inc()
            raise HTTPError(503, "the model is still loading; retry when /ready is 200",
                            kind="unavailable", headers={"Retry-After": "5"})

    async def start(self, prompts: list[list[int]], decodes: list[DecodeConfig], thinking: bool,
                    stop: list[str] | None = None, logprobs: bool = False) -> list[Request]:
        """Queues one request per (prompt, decode), all or none."""
        self.available()
        for p, d in zip(prompts, decodes, strict=True):
            try:  # a request larger than the whole KV pool could never start
                self.scheduler.engine.check_fits(p, d, where="max_tokens")
            except UserError as e:
                raise HTTPError(400, str(e), param="max_tokens") from None
        loop = asyncio.get_running_loop()
        reqs = [Request(id=f"req-{uuid.uuid4().hex[:16]}", prompt=p, decode=d, loop=loop,
                        thinking=thinking, stops=StopStrings(stop) if stop else None,
                        logprobs=logprobs)
                for p, d in zip(prompts, decodes, strict=True)]
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


def request_id(request: HTTPRequest) -> str:
    """The client's X-Request-Id when it is a plain token, else a fresh one (never echo control
    bytes or unbounded text into headers and logs)."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def build_apps(svc: Service, admin_port: bool = True) -> tuple[Starlette, Starlette]:
    """(data app, admin app). Without an admin port, /metrics is served on the data app too."""

    def route(path: str, methods: list[str], name: str):
        def wrap(handler):
            async def endpoint(request: HTTPRequest) -> Response:
                t0 = time.perf_counter()
                rid = request.state.rid = request_id(request)
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
        svc.available()  # a request refused while loading spends no rate-limit token
        svc.limit_rate(caller)
        return await svc.read_json(request)

    @route("/v1/completions", ["POST"], "completions")
    async def completions(request):
        req = svc.parse(protocol.CompletionRequest, await guarded(request), request)
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        prompts = [svc.encode(p, "prompt" if len(texts) == 1 else f"prompt[{i}]")
                   for i, p in enumerate(texts)]
        return await respond(request, req, prompts, chat_format=False)

    @route("/v1/chat/completions", ["POST"], "chat_completions")
    async def chat_completions(request):
        req = svc.parse(protocol.ChatCompletionRequest, await guarded(request), request)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        extra = req.chat_template_kwargs.model_extra if req.chat_template_kwargs else {}
        try:
            text = svc.template.render(messages, svc.thinking(req), **(extra or {}))
        except UserError as e:
            raise HTTPError(400, str(e), param="messages") from None
        return await respond(request, req, [svc.encode(text, "messages")], chat_format=True)

    async def respond(request, req, prompts: list[list[int]], chat_format: bool) -> Response:
        """Runs req.n choices per prompt (choice index = prompt * n + j) and answers in the
        OpenAI shape (openai_response.Choices), streamed or not."""
        thinking, n = svc.thinking(req), req.n
        if len(prompts) * n > svc.cfg.server.max_segments:  # n == 1: the prompt list is too long
            raise HTTPError(400, f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; "
                                 f"the limit is {svc.cfg.server.max_segments}",
                            param="n" if n > 1 else "prompt")
        decodes, budget = svc.decode_configs(req, thinking, len(prompts) * n, "max_tokens")
        if budget is not None:  # an explicit token budget must fit beside every prompt
            for i, ids in enumerate(prompts):
                svc.check_room(ids, decodes[0], "messages" if chat_format else
                               ("prompt" if len(prompts) == 1 else f"prompt[{i}]"), budget)
        prompt_of = [i // n for i in range(len(prompts) * n)]
        with_logprobs = protocol.wants_logprobs(req)
        reqs = await svc.start([prompts[p] for p in prompt_of], decodes, thinking, req.stop,
                               with_logprobs)
        choices = Choices(reqs, prompt_of, chat_format=chat_format, thinking=thinking,
                          logprobs=with_logprobs, tokenizer=svc.scheduler.engine.tokenizer,
                          model_name=svc.model_name)
        if not req.stream:
            results = await unless_gone(request, reqs,
                                        asyncio.gather(*(svc.collect(r) for r in reqs)))
            return JSONResponse(choices.body(results))

        events: asyncio.Queue = asyncio.Queue()  # (choice index, event) of every choice

        async def pump(i: int, r: Request) -> None:
            while True:
                event = await r.events.get()
                events.put_nowait((i, event))
                if event[0] != "tokens":
                    return

        pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]

        def stop_all() -> None:
            for task in pumps:
                task.cancel()
            for r in reqs:  # a client that went away frees its rows at the next step
                r.cancelled = True

        # The stream opens with the first committed block: a request refused while it waited
        # (queue timeout, shutdown, engine failure) gets a real status code, not an in-band error.
        try:
            first = await unless_gone(request, reqs, events.get())
        except BaseException:
            stop_all()
            raise
        if first[1][0] == "error":
            stop_all()
            raise engine_error(first[1][1], first[1][2])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            results: list = [None] * len(reqs)
            try:
                for line in choices.opening():
                    yield line
                i, event = first
                while True:
                    if event[0] == "tokens":
                        line = choices.tokens(i, event[1], event[2], event[3])
                        if line is not None:
                            yield line
                    elif event[0] == "done":
                        results[i] = event[1]
                        yield choices.done(i, event[1])
                        if all(r is not None for r in results):
                            if include_usage:
                                yield choices.sse([], usage=choices.usage(results))
                            break
                    else:  # after the stream started: a typed error event
                        e = engine_error(event[1], event[2])
                        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'code': e.status}})}\n\n"
                        break
                    i, event = await events.get()
                yield "data: [DONE]\n\n"
            finally:
                stop_all()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @route("/generate", ["POST"], "generate")
    async def generate(request):
        """Segments decoded together. A segment that fails (a queue timeout, say) gets its own
        error entry; the others keep their results. Only when every segment failed is the
        response an error."""
        req = svc.parse(protocol.GenerateRequest, await guarded(request), request)
        if len(req.segments) > svc.cfg.server.max_segments:
            raise HTTPError(400, f"{len(req.segments)} segments; the limit is "
                                 f"{svc.cfg.server.max_segments}", param="segments")
        thinking = svc.thinking(req)
        decodes, budget = svc.decode_configs(req, thinking, len(req.segments), "max_new_tokens")
        ids = [svc.encode(s, f"segments[{i}]") for i, s in enumerate(req.segments)]
        if budget is not None:
            for i, p in enumerate(ids):
                svc.check_room(p, decodes[0], f"segments[{i}]", budget)
        reqs = await svc.start(ids, decodes, thinking, req.stop)  # all segments batched together
        results = await unless_gone(request, reqs, asyncio.gather(
            *(svc.collect(r) for r in reqs), return_exceptions=True))
        failed = [r for r in results if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, HTTPError):
                raise r
        if len(failed) == len(results):
            raise failed[0]

        def segment(r) -> dict:
            if isinstance(r, HTTPError):
                return {"error": {"message": r.message, "type": r.kind, "code": r.status}}
            return {"tokens": len(r.token_ids), "nfe": r.nfe, "tpf": round(r.tpf, 4),
                    "bubble_forwards": r.bubble_forwards, "finish_reason": r.finish_reason,
                    **voting_info(r)}

        return JSONResponse({"output": [None if isinstance(r, HTTPError) else r.text
                                        for r in results],
                             "segments": [segment(r) for r in results]})

    @route("/openapi.json", ["GET"], "openapi")
    async def openapi_schema(request):
        return JSONResponse(OPENAPI)

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

    # ------------------------------------------------------------ admin
    @route("/metrics", ["GET"], "metrics")
    async def metrics(request):
        if not svc.cfg.monitoring.enabled:
            raise HTTPError(404, "monitoring is disabled")
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    handlers = {StarletteHTTPException: http_exception}
    data = Starlette(routes=[completions, chat_completions, generate, models, model, health,
                             ready, openapi_schema] + ([] if admin_port else [metrics]),
                     exception_handlers=handlers)

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
