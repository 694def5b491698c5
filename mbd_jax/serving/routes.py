"""The service's routes (Starlette): OpenAI-compatible completions and chat completions with n
choices, streamed or not; /generate; models; health and readiness; the admin app's metrics and
profiler. Each handler is a method of `Routes` over one `Service` (app.py: validation, limits,
the hand-off to the scheduler); `route` wraps it with the error shape, the request id, the
request counter and the access log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import jax
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mbd_jax.errors import UserError
from mbd_jax.serving import access, protocol, tool_use
from mbd_jax.serving.app import (ClientGone, HTTPError, Service, _shown, engine_error,
                                 error_response, request_id, unless_gone)
from mbd_jax.serving.openai_response import Choices, voting_info
from mbd_jax.serving.request import Request

log = logging.getLogger("mbd_jax.serving")


def build_apps(svc: Service, admin_port: bool = True) -> tuple[Starlette, Starlette]:
    """(data app, admin app). Without an admin port, /metrics is served on the data app too."""
    r = Routes(svc)
    metrics = route(svc, "/metrics", ["GET"], "metrics", r.metrics)
    health = route(svc, "/health", ["GET"], "health", r.health)
    data = [route(svc, "/v1/completions", ["POST"], "completions", r.completions),
            route(svc, "/v1/chat/completions", ["POST"], "chat_completions", r.chat_completions),
            route(svc, "/generate", ["POST"], "generate", r.generate),
            route(svc, "/v1/models", ["GET"], "models", r.models),
            route(svc, "/v1/models/{model_id:path}", ["GET"], "model", r.model),
            health, route(svc, "/ready", ["GET"], "ready", r.ready),
            route(svc, "/openapi.json", ["GET"], "openapi", r.openapi)]
    admin = [metrics, route(svc, "/admin/profile", ["POST"], "profile", r.profile), health]
    handlers = {StarletteHTTPException: http_exception}
    return (Starlette(routes=data + ([] if admin_port else [metrics]), exception_handlers=handlers),
            Starlette(routes=admin, exception_handlers=handlers))


# Paths a load balancer or Prometheus polls every few seconds: their log lines are DEBUG
PROBES = frozenset({"/health", "/ready", "/metrics"})


def route(svc: Service, path: str, methods: list[str], name: str, handler) -> Route:
    """A Route whose endpoint answers `handler`'s response, or the JSON error of an HTTPError (a
    client gone: 499; anything else: 500, logged), with the request id header. When the answer
    has gone out (a stream: once it ended; cut by the client: 499) the request is counted, its
    tokens are charged to its key's budget, and the access log has its line (access.py)."""

    async def endpoint(request: HTTPRequest) -> Response:
        t0 = time.perf_counter()
        rid = request.state.rid = request_id(request)
        request.state.route, request.state.jobs = name, []
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

        def finished(status: int) -> None:
            svc.metrics.requests.labels(name, str(status)).inc()
            svc.gate.charge(getattr(request.state, "caller", None), sum(access.tokens(request)))
            access.line(request, path, status, (time.perf_counter() - t0) * 1e3, path in PROBES)

        if isinstance(response, StreamingResponse):
            return WatchedStream(response, finished)
        finished(response.status_code)
        return response
    return Route(path, endpoint, methods=methods, name=name)


class WatchedStream:
    """A streamed response that reports how it ended: its status once every chunk went out,
    499 when the client left first (Starlette then stops sending, without an error)."""

    def __init__(self, response: StreamingResponse, finished) -> None:
        self.response, self.finished, self.complete = response, finished, False
        chunks = response.body_iterator

        async def body():
            async for chunk in chunks:
                yield chunk
            self.complete = True

        response.body_iterator = body()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.finished(self.response.status_code if self.complete else 499)


async def http_exception(request: HTTPRequest, exc: StarletteHTTPException) -> Response:
    """Unknown routes (404) and wrong methods (405) answer in the same JSON error shape."""
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(HTTPError(exc.status_code, message, kind="invalid_request_error",
                                    headers=dict(exc.headers or {})))


class Routes:
    def __init__(self, svc: Service):
        self.svc = svc

    async def _guarded(self, request: HTTPRequest) -> dict:
        caller = self.svc.authorize(request, request.state.route)
        self.svc.available()  # a request refused while loading spends no rate-limit token
        self.svc.admit(caller)
        return await self.svc.read_json(request)

    async def completions(self, request):
        req = self.svc.parse(protocol.CompletionRequest, await self._guarded(request), request)
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        prompts = [self.svc.encode(p, "prompt" if len(texts) == 1 else f"prompt[{i}]")
                   for i, p in enumerate(texts)]
        return await self._respond(request, req, prompts, chat_format=False)

    async def chat_completions(self, request):
        req = self.svc.parse(protocol.ChatCompletionRequest, await self._guarded(request), request)
        try:
            tools = tool_use.read(req)
        except tool_use.ToolError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        extra = req.chat_template_kwargs.model_extra if req.chat_template_kwargs else {}
        try:
            text = self.svc.template.render(messages, self.svc.thinking(req),
                                            tools=tools and tools.shown, **(extra or {}))
        except UserError as e:
            raise HTTPError(400, str(e), param="messages") from None
        return await self._respond(request, req, [self.svc.encode(text, "messages")],
                                   chat_format=True, tools=tools)

    async def _respond(self, request, req, prompts: list[list[int]], chat_format: bool,
                       tools: tool_use.ToolUse | None = None) -> Response:
        """Runs req.n choices per prompt (choice index = prompt * n + j) and answers in the
        OpenAI shape (openai_response.Choices), streamed or not; `tools`: a chat's tool use."""
        thinking, n = self.svc.thinking(req), req.n
        if len(prompts) * n > self.svc.cfg.server.max_segments:  # n == 1: too many prompts
            raise HTTPError(400, f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; "
                                 f"the limit is {self.svc.cfg.server.max_segments}",
                            param="n" if n > 1 else "prompt")
        # off the event loop: a structured request compiles its grammar here (a large schema, or
        # the first one building the tokenizer's grammar view, takes long enough to stall
        # every other connection)
        decodes, budget = await asyncio.to_thread(self.svc.decode_configs, req, thinking,
                                                  len(prompts) * n, "max_tokens", tools)
        if budget is not None:  # an explicit token budget must fit beside every prompt
            for i, ids in enumerate(prompts):
                self.svc.check_room(ids, decodes[0], "messages" if chat_format else
                                    ("prompt" if len(prompts) == 1 else f"prompt[{i}]"), budget)
        prompt_of = [i // n for i in range(len(prompts) * n)]
        with_logprobs = protocol.wants_logprobs(req)
        reqs = await self.svc.start([prompts[p] for p in prompt_of], decodes, thinking, req.stop,
                                    with_logprobs)
        request.state.jobs = reqs
        choices = Choices(reqs, prompt_of, chat_format=chat_format, thinking=thinking,
                          logprobs=with_logprobs, tokenizer=self.svc.scheduler.engine.tokenizer,
                          model_name=self.svc.model_name, tools=tools)
        if not req.stream:
            results = await unless_gone(request, reqs,
                                        asyncio.gather(*(self.svc.collect(r) for r in reqs)))
            return JSONResponse(choices.body(results))
        return await self._stream(request, req, reqs, choices)

    async def _stream(self, request, req, reqs: list[Request], choices: Choices) -> Response:
        """The choices as server-sent events, opened once the first block is committed."""
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
                        error = {"message": e.message, "type": e.kind, "code": e.status}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                        break
                    i, event = await events.get()
                yield "data: [DONE]\n\n"
            finally:
                stop_all()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def generate(self, request):
        """Segments decoded together. Each segment is checked on its own: one that is bad (empty,
        too long for the context) or fails (a queue timeout, say) gets its own error entry, the
        others are served. Only when every segment failed is the response an error; what is
        wrong with the request as a whole (its fields, too many segments) is a 400."""
        req = self.svc.parse(protocol.GenerateRequest, await self._guarded(request), request)
        if len(req.segments) > self.svc.cfg.server.max_segments:
            raise HTTPError(400, f"{len(req.segments)} segments; the limit is "
                                 f"{self.svc.cfg.server.max_segments}", param="segments")
        thinking = self.svc.thinking(req)
        decodes, budget = await asyncio.to_thread(self.svc.decode_configs, req, thinking,
                                                  len(req.segments), "max_new_tokens")
        results: list = [None] * len(req.segments)
        ids = {}  # segment index -> its token ids, for the segments that passed their checks
        for i, s in enumerate(req.segments):
            try:
                ids[i] = self.svc.encode(s, f"segments[{i}]")
                if budget is not None:
                    self.svc.check_room(ids[i], decodes[i], f"segments[{i}]", budget)
            except HTTPError as e:
                results[i] = e
                ids.pop(i, None)
        if ids:
            reqs = await self.svc.start(list(ids.values()), [decodes[i] for i in ids], thinking,
                                        req.stop)  # batched together
            request.state.jobs = reqs
            done = await unless_gone(request, reqs, asyncio.gather(
                *(self.svc.collect(r) for r in reqs), return_exceptions=True))
            for i, r in zip(ids, done):
                results[i] = r
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

    async def openapi(self, request):
        return JSONResponse(self.svc.openapi)

    def _model_card(self) -> dict:
        return {"id": self.svc.model_name, "object": "model", "created": 0, "owned_by": "mbd-jax",
                "max_model_len": self.svc.scheduler.engine.cfg.max_seq_len}

    async def models(self, request):
        self.svc.authorize(request, "models")
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        self.svc.authorize(request, "model")
        if request.path_params["model_id"] != self.svc.model_name:
            raise HTTPError(404, f"model '{_shown(request.path_params['model_id'])}' does not "
                                 f"exist; this server serves '{self.svc.model_name}'",
                            param="model", kind="not_found_error")
        return JSONResponse(self._model_card())

    async def health(self, request):
        """200 while the process can serve (also while loading or draining); 503 once its engine
        has failed for good (the process is on its way out)."""
        if self.svc.scheduler.error is not None:
            raise HTTPError(503, "the engine has failed", kind="unavailable")
        return JSONResponse({"status": "ok"})

    async def ready(self, request):
        if self.svc.scheduler.draining:
            raise HTTPError(503, "draining", kind="unavailable")
        if self.svc.scheduler.error is not None or not self.svc.scheduler.ready:
            raise HTTPError(503, "engine failed" if self.svc.scheduler.error else "starting",
                            kind="unavailable")
        engine = self.svc.scheduler.engine  # the larger buckets may still be compiling
        return JSONResponse({"status": "ready", "prefill_chunk": engine.prefill_chunk,
                             "prefill_chunk_compiled": engine.prefill_ready})

    async def metrics(self, request):
        if not self.svc.cfg.monitoring.enabled:
            raise HTTPError(404, "monitoring is disabled")
        return Response(self.svc.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def profile(self, request):
        self.svc.authorize(request, "profile", admin=True)
        body = await self.svc.read_json(request)
        seconds = body.get("seconds")
        if (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                or not 0 < seconds <= 300):
            raise HTTPError(400, "field 'seconds' must be a number in (0, 300]", param="seconds")
        if self.svc.profiling:
            raise HTTPError(409, "a profile is already being captured", kind="conflict")
        self.svc.profiling = True
        out = self.svc.profile_dir / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        try:
            jax.profiler.start_trace(str(out))
            await asyncio.sleep(seconds)
        finally:
            jax.profiler.stop_trace()
            self.svc.profiling = False
        return JSONResponse({"directory": str(out.resolve()), "seconds": seconds})
