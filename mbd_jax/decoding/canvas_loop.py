"""DiffusionGemma's generation: a jitted while-loop of denoising steps per canvas, and the
canvas-by-canvas driver around it (prefill, denoise, commit the argmax canvas through the
encoder pass, stop at an EOS).

    results = generate(params, cfg, prompts, decodings)

Rows run side by side, each with its own settings, steps and stop (a row whose canvas has
settled waits, unchanged, for the others). This is the family's reference generator over a
dense cache; the engine's paged, continuously batched path is held to its tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config.diffusion_gemma import CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.decoding import canvas as rules
from mbd_jax.model import diffusion_gemma as dg

# Rows whose [C, V] logits and sampler arrays a step holds at once: at DiffusionGemma's 256 x
# 262,144 vocabulary one row's float32 logits are 268 MB, and the step's sampler (processed
# logits, probabilities, Gumbel noise) holds a few such arrays per row.
SAMPLER_ROWS = 4


@flax.struct.dataclass
class CanvasParams:
    """Per-row settings, [B] each (CanvasDecoding)."""

    steps: jax.Array
    entropy_bound: jax.Array
    t_min: jax.Array
    t_max: jax.Array
    stability: jax.Array
    confidence: jax.Array
    deterministic: jax.Array  # bool: noise "deterministic"
    seed: jax.Array

    @classmethod
    def of(cls, decodings: Sequence[CanvasDecoding]) -> CanvasParams:
        col = lambda f, dt: jnp.asarray(np.array([f(d) for d in decodings], dt))  # noqa: E731
        return cls(steps=col(lambda d: d.steps, np.int32),
                   entropy_bound=col(lambda d: d.entropy_bound, np.float32),
                   t_min=col(lambda d: d.t_min, np.float32), t_max=col(lambda d: d.t_max, np.float32),
                   stability=col(lambda d: d.stability, np.int32),
                   confidence=col(lambda d: d.confidence, np.float32),
                   deterministic=col(lambda d: d.noise == "deterministic", bool),
                   seed=col(lambda d: d.seed, np.int32))


@flax.struct.dataclass
class CanvasState:
    canvas: jax.Array  # [B, C] what the next decoder pass reads
    argmax: jax.Array  # [B, C] the latest argmax canvas (what commits)
    soft: jax.Array  # [B, C, D] the last step's soft embedding (self-conditioning)
    history: jax.Array  # [B, H, C] the last H argmax canvases, newest first (-1: none)
    steps_done: jax.Array  # [B] decoder passes on this canvas
    done: jax.Array  # [B] bool: the canvas has settled (or ran its steps)
    index: jax.Array  # [B] the canvas's index in the row's generation


def _keys(p: CanvasParams, index: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: (the sampling key, the noise key) of draw k of canvas `index`."""
    base = jax.vmap(lambda s, c, n: jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(s), c), n))(p.seed, index, k)
    split = jax.vmap(lambda key: jax.random.split(key))(base)
    return split[:, 0], split[:, 1]


def start_canvas(cfg: DiffusionGemmaConfig, p: CanvasParams, index: jax.Array, done: jax.Array,
                 history: int) -> CanvasState:
    """A fresh canvas of noise (draw k = 0) for each row; `done` rows take no steps."""
    b, c = index.shape[0], cfg.canvas_length
    _, noise_key = _keys(p, index, jnp.zeros_like(index))
    canvas = rules.noise(p.deterministic, noise_key, index, jnp.zeros_like(index), c,
                         cfg.vocab_size)
    return CanvasState(canvas=canvas, argmax=canvas,
                       soft=jnp.zeros((b, c, cfg.hidden_size), jnp.dtype(cfg.dtype)),
                       history=jnp.full((b, history, c), -1, jnp.int32),
                       steps_done=jnp.zeros(b, jnp.int32), done=done, index=index)


def denoise_step(params, cfg: DiffusionGemmaConfig, p: CanvasParams, st: CanvasState,
                 cache: dg.Cache, cached_len: jax.Array, commit: jax.Array | None = None,
                 sampler_rows: int = SAMPLER_ROWS, commit_rows: jax.Array | None = None
                 ) -> tuple[CanvasState, dg.Cache]:
    """One decoder pass over every row's canvas and the sampler's update of the live rows.
    `commit` [B, C]: the previous canvas, committed by this same forward (its encoder pass at
    cached_len - C) before the canvas reads it, for the rows `commit_rows` [B] selects
    (default all; the others' cache keeps what it holds there). The LM head and the sampler
    run `sampler_rows` rows at a time (_sample_rows), so a step holds that many rows' [C, V]
    arrays, not the batch's. Returns (the state, the cache)."""
    c, v = cfg.canvas_length, cfg.vocab_size
    start = cached_len if commit is None else cached_len - c
    cache, h = dg.forward(params, cfg, commit, start, cache, st.canvas, st.soft,
                          st.steps_done > 0, head=False, write=commit_rows)  # h: [B, C, D]
    t = rules.temperature(p.steps - st.steps_done, p.steps, p.t_min, p.t_max)
    k = st.steps_done + 1  # this step's draws: the n-th re-draw
    sample_key, noise_key = _keys(p, st.index, k)
    sample, argmax, ent, soft = jax.lax.map(
        lambda row: _sample_rows(params, cfg, *row), (h, t, p.deterministic, sample_key),
        batch_size=min(sampler_rows, h.shape[0]))
    accepted = rules.accept(ent, p.entropy_bound)
    fresh = rules.noise(p.deterministic, noise_key, st.index, k, c, v)
    canvas = jnp.where(accepted, sample, fresh)  # nothing is sticky: the rest re-drawn
    remembered = st.history.shape[1]
    held = ((st.history == argmax[:, None]).all(-1)
            | (jnp.arange(remembered)[None] >= p.stability[:, None]))
    settled = jnp.all(held, axis=1) & (jnp.mean(ent, axis=-1) < p.confidence)
    live = ~st.done
    pick = lambda new, old: jnp.where(  # noqa: E731
        live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    steps_done = st.steps_done + live
    return st.replace(
        canvas=pick(canvas, st.canvas), argmax=pick(argmax, st.argmax),
        soft=pick(soft, st.soft),
        history=pick(jnp.concatenate([argmax[:, None], st.history[:, :-1]], axis=1), st.history),
        steps_done=steps_done, done=st.done | (live & (settled | (steps_done >= p.steps)))), cache


def _sample_rows(params, cfg: DiffusionGemmaConfig, h: jax.Array, t: jax.Array,
                 deterministic: jax.Array, key: jax.Array):
    """One row's sampler (lax.map runs it over rows, in chunks): h [C, D] -> (the draw, the
    argmax [C], the entropy [C] of processed = logits / t, its soft embedding [C, D])."""
    processed = dg.logits_of(params, cfg, h[None]) / t  # [1, C, V]
    sample = rules.draw(processed, deterministic[None], key[None])
    argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    return (sample[0], argmax[0], rules.entropy(processed)[0],
            dg.soft_embedding(params, cfg, processed)[0])


def denoise(params, cfg: DiffusionGemmaConfig, p: CanvasParams, st: CanvasState,
            cache: dg.Cache, cached_len: jax.Array, commit: jax.Array | None = None,
            sampler_rows: int = SAMPLER_ROWS) -> tuple[CanvasState, dg.Cache]:
    """Steps until every row's canvas has settled or run its steps; with `commit` (the
    previous canvas) the first step also commits it (MultiBD for canvases: one forward fewer
    per canvas). Returns (the state, the cache)."""
    if commit is not None:  # every row takes part in the commit, settled or not
        st, cache = denoise_step(params, cfg, p, st, cache, cached_len, commit, sampler_rows)
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: denoise_step(params, cfg, p, s, cache, cached_len,
                               sampler_rows=sampler_rows)[0], st), cache


def engine_round(params, cfg: DiffusionGemmaConfig, p: CanvasParams, st: CanvasState,
                 cache: dg.Cache, cached_len: jax.Array, index: jax.Array, fresh: jax.Array,
                 idle: jax.Array, commit: jax.Array | None, commit_rows: jax.Array,
                 max_steps: jax.Array, sampler_rows: int = SAMPLER_ROWS
                 ) -> tuple[CanvasState, dg.Cache, jax.Array]:
    """The engine's decode call over rows at different places in their generations: rows
    `fresh` [B] start a new canvas, `idle` [B] rows take no steps, then
    every live row steps until one of them finishes its canvas or `max_steps` passed. index
    [B]: each fresh row's canvas index in its generation. `commit`
    [B, C] (the rows `commit_rows` [B] select): previous canvases that the first step commits
    (MultiBD for canvases). A row's tokens never depend on the other rows. Returns (the
    state, the cache, the decoder passes this call ran)."""
    new = start_canvas(cfg, p, index, idle, st.history.shape[1])
    st = jax.tree.map(lambda a, b: jnp.where(
        fresh.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, st)
    st = st.replace(done=st.done | idle)
    before = st.done
    st, cache = denoise_step(params, cfg, p, st, cache, cached_len, commit, sampler_rows,
                             commit_rows)

    def running(carry):
        s, n = carry
        return ~jnp.any(s.done & ~before) & ~jnp.all(s.done) & (n < max_steps)

    def step(carry):
        s, n = carry
        return denoise_step(params, cfg, p, s, cache, cached_len,
                            sampler_rows=sampler_rows)[0], n + 1

    st, passes = jax.lax.while_loop(running, step, (st, jnp.int32(1)))
    return st, cache, passes


@dataclasses.dataclass
class CanvasResult:
    token_ids: list[int]  # whole canvases; after the first EOS every position is pad
    finish_reason: str  # "stop" (an EOS) or "length"
    decoder_passes: int
    canvases: int
    forwards: int  # every forward the row took part in: prefill, decoder passes, commits

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(self.decoder_passes, 1)


def generate(params, cfg: DiffusionGemmaConfig, prompts: Sequence[Sequence[int]],
             decodings: Sequence[CanvasDecoding], sampler_rows: int = SAMPLER_ROWS
             ) -> list[CanvasResult]:
    """Each prompt's canvases, side by side: prefill, then per canvas denoise, take the argmax
    canvas and, unless the row ends (an EOS in it, or its canvases run out), commit it.
    `sampler_rows`: rows whose LM head and sampler run at once (denoise_step)."""
    b, c = len(prompts), cfg.canvas_length
    for i, d in enumerate(decodings):  # every value in range before it reaches the device
        d.validate(f"decoding[{i}]")
    p = CanvasParams.of(decodings)
    budget = np.array([math.ceil(d.max_new_tokens / c) for d in decodings])
    lengths = np.array([len(x) for x in prompts], np.int32)
    capacity = int(lengths.max() + budget.max() * c)
    tokens = np.full((b, int(lengths.max())), cfg.pad_token_id, np.int32)
    for i, x in enumerate(prompts):
        tokens[i, : len(x)] = x
    cache = _encode(params, cfg, jnp.asarray(tokens), jnp.zeros(b, jnp.int32),
                    dg.allocate_cache(cfg, b, capacity))
    history = max(1, max(d.stability for d in decodings))
    fused = _one(decodings, "buffer_size") == 2
    out = [[] for _ in range(b)]
    passes, forwards = np.zeros(b, np.int64), np.ones(b, np.int64)  # the prefill
    done = np.zeros(b, bool)
    cached, pending = jnp.asarray(lengths), None  # fused: the canvas the next forward commits
    for index in range(int(budget.max())):
        done |= index >= budget
        fresh = start_canvas(cfg, p, jnp.full(b, index, jnp.int32), jnp.asarray(done), history)
        st, cache = _denoise(params, cfg, p, fresh, cache, cached, pending, sampler_rows)
        argmax, steps = np.asarray(st.argmax), np.asarray(st.steps_done)
        for i in np.flatnonzero(~done):
            out[i] += _pad_after_eos(cfg, argmax[i].tolist())
            passes[i] += steps[i]
            forwards[i] += steps[i] + (index > 0 and not fused)  # + its own commit forward
        done |= np.isin(argmax, cfg.eos_token_ids).any(axis=1)
        if done.all():
            break
        if fused:  # the commit rides on the next canvas's first step
            pending = st.argmax
        else:
            cache = _encode(params, cfg, st.argmax, cached, cache)
        cached = cached + c
    return [CanvasResult(out[i], "stop" if any(t in cfg.eos_token_ids for t in out[i]) else
                         "length", int(passes[i]), len(out[i]) // c, int(forwards[i]))
            for i in range(b)]


def _one(decodings: Sequence[CanvasDecoding], field: str):
    """A setting every row of one generate call must share (the schedule is the batch's)."""
    values = {getattr(d, field) for d in decodings}
    if len(values) > 1:
        raise ValueError(f"decoding: field '{field}' differs between the rows of one call "
                         f"({sorted(values)}); it is the batch's schedule")
    return values.pop()


def _pad_after_eos(cfg: DiffusionGemmaConfig, canvas: list[int]) -> list[int]:
    eos = next((j for j, t in enumerate(canvas) if t in cfg.eos_token_ids), None)
    return canvas if eos is None else canvas[: eos + 1] + [cfg.pad_token_id] * (len(canvas) - eos - 1)


@functools.partial(jax.jit, static_argnums=1)
def _encode(params, cfg, tokens, start, cache):
    return dg.encode(params, cfg, tokens, start, cache)


@functools.partial(jax.jit, static_argnums=(1, 7))
def _denoise(params, cfg, p, st, cache, cached_len, commit, sampler_rows):
    return denoise(params, cfg, p, st, cache, cached_len, commit, sampler_rows)
