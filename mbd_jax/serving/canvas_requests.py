"""A request's decoding settings for a canvas model (DiffusionGemma: engine/canvas_engine.py):
the model's defaults (its generation.yaml `canvas` section), the server's token budget, then the
request's `decoding` object (CanvasDecoding's fields), seed and max_tokens; `temperature: 0`
(greedy) is the deterministic contract's argmax draws. What the family does not have is refused
by name: other OpenAI sampling values (its temperature is a schedule: decoding.t_min / t_max),
log-probabilities, structured output and forced tool calls."""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic

from mbd_jax.config.diffusion_gemma import CanvasDecoding
from mbd_jax.config.fields import from_dict
from mbd_jax.errors import UserError
from mbd_jax.serving import protocol, structured
from mbd_jax.serving.errors import HTTPError

# OpenAI sampler fields: the values this family takes (they change nothing, or temperature 0:
# greedy, the deterministic contract's argmax draws) and what it takes instead of the others
NEUTRAL = {"temperature": (0,), "top_p": (1,), "top_k": (0, -1)}
NOT_TAKEN = {"temperature": "its temperature is a schedule: set decoding.t_min and decoding.t_max "
                            "(0 is taken: greedy, decoding.noise 'deterministic')",
             "top_p": "it samples the full distribution at the scheduled temperature (1 is taken)",
             "top_k": "it samples the full distribution at the scheduled temperature (0 and -1 "
                      "are taken)"}


def decode_configs(svc, req: Any, thinking: bool, count: int, max_field: str,
                   tools=None) -> tuple[list[CanvasDecoding], str | None]:
    """`count` CanvasDecodings (one per choice; choice j of a seeded request uses seed + j)
    and the field that set the token budget (None: the server default)."""
    gen, engine = svc.cfg.generation, svc.scheduler.engine
    for name, why in NOT_TAKEN.items():
        value = getattr(req, name, None)
        if value is not None and value not in NEUTRAL[name]:
            raise HTTPError(400, f"field '{name}' is not taken by this model ({engine.cfg.name}, "
                                 f"uniform-noise canvases) at {value}: {why}", param=name)
    if protocol.wants_logprobs(req):
        raise HTTPError(400, "field 'logprobs': this model's tokens are chosen by denoising a "
                             "canvas, not drawn one at a time; it has no per-token "
                             "log-probabilities", param="logprobs")
    _refuse_structure(req, tools)
    limit = gen.thinking_max_new_tokens if thinking else gen.max_new_tokens_limit
    base = dataclasses.asdict(engine.defaults) | {"max_new_tokens": min(gen.max_new_tokens, limit)}
    overrides = dict(req.decoding or {})
    max_field, explicit = protocol.token_budget(req, max_field, overrides, limit, thinking)
    if getattr(req, "temperature", None) == 0:
        overrides.setdefault("noise", "deterministic")  # greedy: argmax draws
    if req.seed is not None:
        overrides["seed"] = req.seed % 2**31
    seeded = "seed" in overrides
    try:
        d = from_dict(CanvasDecoding, base | overrides, where="decoding")
        engine.check_decode(d)
    except UserError as e:
        raise protocol.decoding_error(e) from None
    return protocol.per_choice(d, seeded, count), max_field if explicit else None


def _refuse_structure(req: Any, tools) -> None:
    """Structured output and forced tool calls need a grammar over the output; a canvas is
    denoised all at once, so no grammar gates it (not built for this family)."""
    try:
        asked = structured.requested(req)
    except structured.Conflict as e:
        raise HTTPError(400, str(e), param=e.param) from None
    if tools is not None and tools.forced:
        asked = None, "tool_choice"
    if asked is not None:
        raise HTTPError(400, f"field '{asked[1]}': this model (uniform-noise canvases) has no "
                             "constrained decoding; send it without", param=asked[1])


def decoding_schema() -> dict[str, Any]:
    """The `decoding` object's schema for this family: CanvasDecoding's fields, no defaults
    (they are the model's)."""
    schema = pydantic.TypeAdapter(CanvasDecoding).json_schema()
    for prop in schema["properties"].values():
        prop.pop("default", None)
    schema["additionalProperties"] = False
    return schema
