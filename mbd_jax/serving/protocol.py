"""The request bodies the service accepts, as typed models (pydantic); they also publish /openapi.json.

Three kinds of OpenAI field:
- supported: they change the output and we honour them (max_tokens, temperature, top_p, top_k,
  seed, stop, n, stream, ...);
- harmless: they do not change the output here (store, metadata, user, ...); accepted, and the
  ones that would matter elsewhere are named in one warning line per request (`ignored()`);
- unsupported at anything but their neutral value (logprobs, penalties, logit_bias, echo,
  best_of, suffix): any other value is a 400 naming the field, because silently ignoring
  it would change what the client gets.
Structured output (response_format, vLLM's structured_outputs and guided_*) is read by
structured.py; tools, tool_choice and parallel_tool_calls by tool_use.py.
Fields outside the schema are a 400 that lists the allowed ones (a typo must not pass silently).

Validation is strict (no "5" for 5, no true for 1). `error_of` turns pydantic's first error into
(message, param) with the public field path, e.g. messages[0].content.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from mbd_jax.config import DecodeConfig
from mbd_jax.config.decoding import RANGES
from mbd_jax.errors import UserError
from mbd_jax.serving import structured, tool_use
from mbd_jax.serving.errors import HTTPError

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_N = 16  # choices per prompt


def _integral(v: Any) -> Any:
    """37.0 as 37: JSON Schema's integer counts an integer-valued number as one (a client's JSON
    encoder may write it so); 37.5 and true stay what they are, for the int check to refuse."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "top_k", "seed", "n")
DECODING_INTEGERS = frozenset(f.name for f in dataclasses.fields(DecodeConfig) if f.type == "int")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @pydantic.field_validator(*INTEGER_FIELDS, mode="before", check_fields=False)
    @classmethod
    def _integer_valued(cls, v: Any) -> Any:
        return _integral(v)

    @pydantic.field_validator("decoding", mode="before", check_fields=False)
    @classmethod
    def _decoding_integers(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        return {k: _integral(x) if k in DECODING_INTEGERS else x for k, x in v.items()}


def _one_of(check, schema: dict):
    """A field type whose validation is `check` (raising ValueError with a message that says what
    is allowed) and whose published schema is `schema`."""
    return Annotated[Any, BeforeValidator(check), WithJsonSchema(schema)]


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON true is not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)



def _check_prompt(v: Any) -> str | list[str] | list[list[int]]:
    what = "must be a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise ValueError(what + (" (not empty)" if isinstance(v, list) else ""))
    if all(isinstance(p, str) for p in v):
        return v
    v = [[_integral(t) for t in p] if isinstance(p, list) else _integral(p) for p in v]
    if all(is_int(t) for t in v):
        return [v]
    if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in v):
        return v
    raise ValueError(what)


def _check_stop(v: Any) -> list[str] | None:
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ValueError(f"must hold at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
    return stops


def _check_content(v: Any) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                                   for p in v):
        return "\n".join(p["text"] for p in v)
    raise ValueError('must be a string or a list of text parts {"type": "text", "text": "..."} '
                     "(images, audio and files are not supported)")


def _neutral(*allowed: Any, what: str):
    """A field accepted only at one of its neutral values."""
    def check(v: Any) -> Any:
        if any(v == a and type(v) is type(a) for a in allowed) or (v is None and None in allowed):
            return v
        raise ValueError(f"is not supported; only {what}")
    return check


Prompt = _one_of(_check_prompt, {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
     "minItems": 1}]})
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
Stop = _one_of(_check_stop, {"anyOf": [
    _STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP}, {"type": "null"}]})
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"], "additionalProperties": False}}]}
MessageContent = _one_of(lambda v: None if v is None else _check_content(v),
                         {"anyOf": [*_CONTENT_SCHEMA["anyOf"], {"type": "null"}]})


def _unsupported(*allowed: Any, what: str):
    neutral = [a for i, a in enumerate(allowed) if a not in allowed[:i]]  # 0 == 0.0
    return Annotated[Any, BeforeValidator(_neutral(*allowed, what=what)),
                     WithJsonSchema({"enum": neutral})]


# OpenAI fields that would change the output: accepted only at their neutral values.
NoPenalty = _unsupported(0, 0.0, None, what="0")
NoLogitBias = _unsupported({}, None, what="{} or null")
NoTopLogprobs = _unsupported(0, None, what="0 or null (alternatives to the chosen tokens are "
                                           "not recorded)")


def _check_completion_logprobs(v: Any) -> int | None:
    """Completions' `logprobs` (how many alternatives per token): 0 reports the chosen tokens'
    log-probabilities; alternatives are not recorded."""
    if v is None or v is False:
        return None
    if v is True or (is_int(v) and v == 0):
        return 0
    raise ValueError("must be 0 (the chosen tokens' log-probabilities) or null; alternatives "
                     "to the chosen tokens are not recorded")


CompletionLogprobs = _one_of(_check_completion_logprobs, {"enum": [0, False, None]})
NoEcho = _unsupported(False, None, what="false")
NoBestOf = _unsupported(1, None, what="1")
NoSuffix = _unsupported(None, "", what="null")
ResponseFormat = _one_of(structured.check_response_format, structured.RESPONSE_FORMAT_SCHEMA)
StructuredOutputs = _one_of(structured.check_structured_outputs,
                            structured.STRUCTURED_OUTPUTS_SCHEMA)
GuidedJson = _one_of(structured.check_guided_json, structured.GUIDED_JSON_SCHEMA)
GuidedChoice = _one_of(structured.check_guided_choice, structured.GUIDED_CHOICE_SCHEMA)
GuidedRegex = _one_of(structured.check_guided_text("regex"), structured.GUIDED_TEXT_SCHEMA)
GuidedGrammar = _one_of(structured.check_guided_text("grammar"), structured.GUIDED_TEXT_SCHEMA)
Tools = _one_of(tool_use.check_tools, tool_use.TOOLS_SCHEMA)
ToolChoice = _one_of(tool_use.check_tool_choice, tool_use.TOOL_CHOICE_SCHEMA)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: accepted, usage comes with the last chunk


class ChatTemplateKwargs(BaseModel):
    """vLLM / SGLang's `chat_template_kwargs`: enable_thinking is honoured; other keys are passed
    to the model's own template when it has one."""
    model_config = ConfigDict(extra="allow", strict=True)
    enable_thinking: bool | None = None


# Harmless fields: accepted; named in the request's warning line when set.
HARMLESS = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")


class _Sampling(_Body):
    """Fields every generation route shares."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**30, description="-1 or 0: off")
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Stop = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    decoding: dict[str, Any] | None = Field(
        default=None, description="mbd-jax decoding settings (DecodeConfig fields)")
    thinking: bool | None = Field(default=None, description="mbd-jax: thinking mode on or off")
    # Structured output (structured.py): at most one of these.
    response_format: ResponseFormat = None
    structured_outputs: StructuredOutputs = None
    guided_json: GuidedJson = None
    guided_regex: GuidedRegex = None
    guided_choice: GuidedChoice = None
    guided_grammar: GuidedGrammar = None
    # OpenAI fields that would change the output: only their neutral values (see above).
    frequency_penalty: NoPenalty = None
    presence_penalty: NoPenalty = None
    logit_bias: NoLogitBias = None
    # Harmless.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: CompletionLogprobs = None
    echo: NoEcho = None
    best_of: NoBestOf = None
    suffix: NoSuffix = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text of the arguments object


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent = None  # (null only on an assistant turn that made tool calls)
    name: str | None = None  # accepted, not rendered
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to this call

    @pydantic.model_validator(mode="after")
    def _content_or_calls(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("'content' is required (it may be null only on an assistant "
                             "turn with tool_calls)")
        for call in self.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError("tool_calls[].function.arguments must be a JSON object's text")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: NoTopLogprobs = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Tools = None  # tool_use.py
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # harmless: thinking is on/off here (`thinking`)


class GenerateRequest(_Body):
    """mbd-jax's own batch route: several segments decoded together."""

    segments: list[str] = Field(min_length=1)  # each checked on its own (an empty one: its error)
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**30)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Stop = None
    decoding: dict[str, Any] | None = None
    thinking: bool | None = None


def wants_logprobs(req: BaseModel) -> bool:
    value = getattr(req, "logprobs", None)
    return value is not None and value is not False  # completions send 0 (== False) for "on"


def ignored(req: BaseModel) -> list[str]:
    """The harmless fields the request set (for its warning line)."""
    names = [f for f in HARMLESS if getattr(req, f, None) is not None]
    if getattr(req, "parallel_tool_calls", None) is not None and not req.tools:
        names.append("parallel_tool_calls")  # (with tools it is honoured)
    if getattr(req, "reasoning_effort", None) is not None:
        names.append("reasoning_effort")
    kwargs = getattr(req, "chat_template_kwargs", None)
    names += [f"chat_template_kwargs.{k}" for k in (kwargs.model_extra or {})] if kwargs else []
    return names


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("function-"):  # pydantic's validator frames
            out += f".{part}" if out else part
    return out


def error_of(model: type[BaseModel], e: pydantic.ValidationError) -> tuple[str, str]:
    """(message, param) for the first problem in `e`, naming the field and what is allowed."""
    err = e.errors(include_url=False)[0]
    param = _path(err["loc"])
    shown = param if len(param) <= 64 else param[:64] + "..."
    if err["type"] == "extra_forbidden":
        fields = model.model_fields if len(err["loc"]) == 1 else None
        allowed = f"; allowed: {', '.join(sorted(fields))}" if fields else ""
        return f"unknown field '{shown}'{allowed}", shown
    if err["type"] == "missing":
        return f"field '{shown}' is required", shown
    msg = err["msg"].removeprefix("Value error, ")
    return f"field '{shown}': {msg[0].lower() + msg[1:]}", shown


def parse(model: type[BaseModel], body: dict) -> Any:
    """`body` validated as `model`; raises ValueError(message, param)."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise RequestError(*error_of(model, e)) from None


def token_budget(req: BaseModel, max_field: str, overrides: dict, limit: int,
                 thinking: bool = False) -> tuple[str, bool]:
    """Puts the request's token budget into overrides["max_new_tokens"]: `max_field`
    (max_tokens, max_new_tokens), or max_completion_tokens, over decoding.max_new_tokens; a
    400 naming the field above `limit`. Returns (the field that set it, whether a top-level
    field did: an explicit budget must fit beside the prompt)."""
    budget = getattr(req, max_field)
    if max_field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        max_field, budget = "max_completion_tokens", req.max_completion_tokens
    if budget is not None:
        overrides["max_new_tokens"] = budget
    elif "max_new_tokens" in overrides:
        max_field = "decoding.max_new_tokens"
    requested = overrides.get("max_new_tokens")
    if is_int(requested) and requested > limit:
        raise HTTPError(400, f"{max_field} must be at most {limit} on this server"
                             + (" for thinking requests" if thinking else "") + f", got "
                             f"{requested}: send {limit} or less (a client with a default "
                             "budget, such as lm-evaluation-harness's max_gen_toks of 256, "
                             "needs it set)", param=max_field)
    return max_field, budget is not None


def decoding_error(e: UserError) -> HTTPError:
    """The 400 of a bad decoding setting, its param the field's public path ("decoding.voting:
    field 'pattern' ..." -> decoding.voting.pattern)."""
    field, where = getattr(e, "field", None), str(e).split(": ", 1)[0]
    where = where if where.startswith("decoding") and " " not in where else "decoding"
    return HTTPError(400, str(e), param=f"{where}.{field}" if field else where)


def per_choice(d: Any, seeded: bool, count: int) -> list[Any]:
    """`count` copies of decoding settings `d`, one per choice: a seeded request's choice j
    with seed + j, an unseeded one's with fresh randomness each."""
    seeds = ([(d.seed + j) % 2**31 for j in range(count)] if seeded
             else [secrets.randbelow(2**31) for _ in range(count)])
    return [dataclasses.replace(d, seed=s) for s in seeds]


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclasses.dataclass(frozen=True)
class Limits:
    """What this server accepts beyond the request models' own bounds, for /openapi.json."""

    model: str  # the served model's name
    max_new_tokens: int  # generation.max_new_tokens_limit
    prompts: int  # server.max_segments: prompts x n, or segments, per request
    vocab_size: int  # token ids in [0, vocab_size) ...
    mask_token_id: int | None  # ... except this one (None: a model without a mask token)
    context: int  # a token-id prompt is shorter than the model's context
    buffer_size: int  # server.buffer_size: the largest decoding.buffer_size
    max_nfe: int  # generation.max_nfe_limit
    can_vote: bool  # decoding.voting is served (the engine records trajectories)
    edit_ops: bool  # sampling_mode "indel" is served (the model has delete / split ids)


def decoding_schema(limits: Limits) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the `decoding` object's schema, the definitions it refers to): DecodeConfig's fields
    with their types, choices and RANGES, capped by this server's limits; no defaults (they are
    the server's and the model's: ServeConfig.decode_defaults)."""
    schema = pydantic.TypeAdapter(DecodeConfig).json_schema(
        ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    caps = {"buffer_size": limits.buffer_size, "max_nfe": limits.max_nfe,
            "max_new_tokens": limits.max_new_tokens}
    props = schema["properties"]
    for name, prop in [*props.items(), *defs["VotingConfig"]["properties"].items()]:
        prop.pop("default", None)
    for name, (lo, hi) in RANGES.items():
        props[name].update(minimum=lo, maximum=min(hi, caps.get(name, hi)))
    props["top_p"].update(exclusiveMinimum=0, maximum=1)
    defs["VotingConfig"]["properties"]["alpha"].update(minimum=0, maximum=100)
    if not limits.can_vote:
        del props["voting"]
    if not limits.edit_ops:
        modes = props["sampling_mode"]["enum"]
        props["sampling_mode"]["enum"] = [m for m in modes if m != "indel"]
    del props["structure"]  # asked for by response_format / structured_outputs (structured.py)
    defs.pop("Structure", None)
    for obj in (schema, defs["VotingConfig"]):
        obj["additionalProperties"] = False
    return schema, defs


def _with_limits(schemas: dict[str, Any], limits: Limits) -> None:
    """Writes `limits` into the published request schemas (in place)."""
    def integer_branch(prop: dict) -> dict:
        return next(s for s in prop.get("anyOf", [prop]) if s.get("type") == "integer")

    token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    if limits.mask_token_id is not None:
        token["not"] = {"const": limits.mask_token_id}
    ids = {"type": "array", "items": token, "minItems": 1, "maxItems": limits.context - 1}
    decoding, defs = decoding_schema(limits)
    schemas.update(defs, DecodeConfig=decoding)
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest"):
        props = schemas[name]["properties"]
        props["decoding"] = {"anyOf": [{"$ref": "#/components/schemas/DecodeConfig"},
                                       {"type": "null"}], "description": "mbd-jax decoding "
                             "settings over the server's defaults"}
        for field in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            if field in props:
                integer_branch(props[field])["maximum"] = limits.max_new_tokens
        if "n" in props:
            props["n"]["maximum"] = min(MAX_N, limits.prompts)
        if "segments" in props:  # (an empty one is answered with its own error entry)
            props["segments"].update(maxItems=limits.prompts,
                                     items={"type": "string", "minLength": 1})
        if "model" in props:  # the one model this server serves
            props["model"] = {"anyOf": [{"enum": [limits.model]}, {"type": "null"}]}
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    prompt[1]["maxItems"] = limits.prompts  # a list of strings
    prompt[2] = ids  # one prompt of token ids
    prompt[3] = {"type": "array", "items": ids, "minItems": 1, "maxItems": limits.prompts}


def openapi(title: str, version: str, limits: Limits | None = None) -> dict:
    """The OpenAPI 3.1 document of the generation routes (with a server's `limits`)."""
    routes = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/generate": GenerateRequest}
    schemas: dict[str, Any] = {}
    paths = {}
    error = {"description": "a client error (4xx) or a server error",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, model in routes.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        paths[path] = {"post": {
            "operationId": model.__name__.removesuffix("Request").lower(),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "the generation (JSON, or text/event-stream "
                                                 "when stream is true)"},
                          "4XX": error, "5XX": error}}}
    schemas["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
    if limits is not None:
        _with_limits(schemas, limits)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas}}
