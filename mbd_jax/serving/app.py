"""The HTTP side of the service: `Service` (authorization, rate limits, body and field
validation, decoding settings, the hand-off to the Scheduler and the wait for results) and the
error shape; the routes over it are routes.py.

HTTP only: nothing here touches a device or blocks the event loop. Every client mistake is a 4xx
with a JSON body {"error": {"message", "type", "param"}} that names the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import re
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mbd_jax import __version__, chat
from mbd_jax.config import DecodeConfig, ServeConfig, Structure, from_dict
from mbd_jax.engine.canvas_engine import CanvasEngine
from mbd_jax.errors import UserError
from mbd_jax.stop_strings import StopStrings
from mbd_jax.serving import canvas_requests, keys, protocol, structured
from mbd_jax.serving.errors import HTTPError
from mbd_jax.serving.tool_use import ToolUse
from mbd_jax.serving.body import BodyError, parse_object
from mbd_jax.serving.request import Request
from mbd_jax.serving.refusals import Draining, EngineDown, QueueFull
from mbd_jax.serving.scheduler import Scheduler

log = logging.getLogger("mbd_jax.serving")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what an X-Request-Id may echo back


def _shown(text: str, limit: int = 64) -> str:
    """A client-supplied name as error messages quote it: at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def engine_error(status: int, message: str) -> HTTPError:
    """The HTTPError for an ("error", status, message) event from the engine thread."""
    if status == 503:  # overload or shutdown: the client may retry
        return HTTPError(503, message, kind="unavailable", headers={"Retry-After": "1"})
    return HTTPError(status, message, kind="timeout" if status == 504 else "server_error")


def error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param,
                                   "code": e.status}}, status_code=e.status, headers=e.headers)


@dataclasses.dataclass
class Service:
    """Everything the routes share."""

    cfg: ServeConfig
    scheduler: Scheduler
    metrics: Any
    model_name: str
    api_keys: list[keys.ApiKey]
    profile_dir: pathlib.Path
    template: chat.Template  # the model's chat template
    profiling: bool = False
    gate: keys.Gate = dataclasses.field(init=False)  # keys, scopes, rates, token budgets
    canvas: bool = dataclasses.field(init=False)  # a canvas model (canvas_requests.py)
    openapi: dict = dataclasses.field(init=False)  # /openapi.json, with this server's limits

    def __post_init__(self):
        s = self.cfg.server
        self.gate = keys.Gate(self.api_keys, s)
        model = self.scheduler.engine.cfg
        self.canvas = isinstance(self.scheduler.engine, CanvasEngine)
        # a canvas model has no mask token and no edit ops
        mask, ops = (None, False) if self.canvas else (model.mask_token_id, bool(model.edit_op_ids))
        self.openapi = protocol.openapi("mbd-jax", __version__, protocol.Limits(
            model=self.model_name, max_new_tokens=self.cfg.generation.max_new_tokens_limit, prompts=s.max_segments,
            vocab_size=model.vocab_size, mask_token_id=mask, context=model.max_seq_len,
            buffer_size=s.buffer_size, max_nfe=self.cfg.generation.max_nfe_limit,
            can_vote=self.scheduler.engine.can_vote, edit_ops=ops))
        if self.canvas:  # the family's own decoding settings
            schemas = self.openapi["components"]["schemas"]
            schemas["DecodeConfig"] = canvas_requests.decoding_schema()

    # ------------------------------------------------------------ request checks
    def authorize(self, request: HTTPRequest, route: str, admin: bool = False) -> keys.Caller:
        """The caller (its key, or its address when the service is open), allowed to call
        `route`: else 401, 403 or 429 (keys.Gate). Kept on request.state for the access log."""
        address = request.client.host if request.client else "anonymous"
        try:
            caller = self.gate.authorize(request.headers.get("authorization", ""), address,
                                         route, admin)
        except keys.Refused as e:
            raise self._refused(e) from None
        request.state.caller = caller
        return caller

    def admit(self, caller: keys.Caller) -> None:
        """One request from the caller's rate, within its token budget; 429 naming the limit."""
        try:
            self.gate.admit(caller)
        except keys.Refused as e:
            raise self._refused(e) from None

    def _refused(self, e: keys.Refused) -> HTTPError:
        self.metrics.rejected.labels(e.reason).inc()
        if e.reason == "rate_limit":
            self.metrics.rate_limited.inc()
        return HTTPError(e.status, e.message, kind=e.kind, headers=e.headers)

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

    def decode_configs(self, req: Any, thinking: bool, count: int, max_field: str,
                       tools: ToolUse | None = None) -> tuple[list[DecodeConfig], str | None]:
        """`count` DecodeConfigs (server defaults + the request's settings, the structure its
        output must have: structured.py, or a forced tool call), one per choice, and
        the field that set the token budget (None: the server default). Choice j of a seeded request uses seed + j;
        an unseeded request gets fresh randomness per choice."""
        if self.canvas:
            return canvas_requests.decode_configs(self, req, thinking, count, max_field, tools)
        gen = self.cfg.generation
        base = self.cfg.decode_defaults(thinking)
        limit = gen.thinking_max_new_tokens if thinking else gen.max_new_tokens_limit
        overrides = dict(req.decoding or {})
        if "structure" in overrides:  # one way in over HTTP: the OpenAI / vLLM fields
            raise HTTPError(400, "decoding: field 'structure' is not taken here; ask for "
                                 "structured output with response_format or structured_outputs",
                            param="decoding.structure")
        max_field, explicit = protocol.token_budget(req, max_field, overrides, limit, thinking)
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
        structure = self.structure(req, tools)
        if structure is not None and thinking:  # the grammar would forbid the reasoning
            raise HTTPError(400, "structured output and forced tool calls need thinking off "
                                 "(the grammar covers the whole reply); send \"thinking\": false",
                            param="thinking")
        if structure is not None:
            overrides["structure"] = structure
        seeded = overrides.get("seed") is not None
        if not seeded:
            overrides["seed"] = 0  # replaced per choice below
        base.update(overrides)
        try:
            d = from_dict(DecodeConfig, base, where="decoding")
            self.scheduler.engine.check_decode(d)
        except UserError as e:
            raise protocol.decoding_error(e) from None
        return protocol.per_choice(d, seeded, count), max_field if explicit else None

    def structure(self, req: Any, tools: ToolUse | None = None) -> Structure | None:
        """The structured output the request asks for (structured.py) or the call grammar of
        a forced tool call, compiled against the model's tokenizer: 400 naming the field that
        holds it if it cannot be."""
        try:
            asked = structured.requested(req)
        except structured.Conflict as e:
            raise HTTPError(400, str(e), param=e.param) from None
        if tools is not None and tools.forced:
            if asked is not None:
                raise HTTPError(400, f"fields 'tool_choice' and '{asked[1].split('.')[0]}' both "
                                     "constrain the output; send one", param="tool_choice")
            asked = tools.structure(), "tools"
        if asked is None:
            return None
        structure, param = asked
        try:
            structure.check_source(param)
            self.scheduler.engine.grammars.check(structure, param)
        except UserError as e:  # (ConfigError is one)
            raise HTTPError(400, str(e), param=param) from None
        return structure

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
