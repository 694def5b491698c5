"""Hugging Face / PyTorch checkpoint -> mbd-jax model directory (config.yaml, params/, tokenizer,
manifest.json).

Families: `llada2_moe` (LLaDA2.0 / 2.1 / 2.2: fused query_key_value, sigmoid grouped routing with
expert_bias, shared experts; 2.2's block routing from `expert_capacity` and its Levenshtein
editing ids from `delete_token_id` / `split_token_id`), `sdar` (Qwen3 architecture), `sdar_moe` (Qwen3-MoE), `qwen3_next` (the Gated
DeltaNet hybrid: Qwen3-Next, and Qwen3.5-MoE's text model, whose linear layers keep q/k/v, z, b
and a in separate projections instead of Qwen3-Next's per-key-head groups). Tensors are read one at a
time (safetensors `safe_open`, or one `.bin` shard at a time) and written into preallocated
parameter arrays of the target dtype, so host memory holds about one copy of the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import time
import typing
from typing import Any, Callable, Iterator

import numpy as np
import yaml

from mbd_jax.checkpoint import save_model, write_manifest
from mbd_jax.config import (GENERATION_FILE, BlockMode, DecodeConfig, ModelConfig, RopeScaling,
                            RopeType, SequenceModule, from_dict)
from mbd_jax.errors import ConfigError, UserError
from mbd_jax.hf_source import CONVERTER_VERSION, TOKENIZER_FILES, TensorSource

FAMILIES = ("llada2_moe", "sdar", "sdar_moe", "qwen3_next", "diffusion_gemma")
MASK_TOKENS = ("<|mask|>", "<|MASK|>", "[MASK]", "<mask>")

log = logging.getLogger("mbd_jax.convert")


# ---------------------------------------------------------------------------- config
def detect_family(hf: dict) -> str:
    model_type = hf.get("model_type", "")
    arch = " ".join(hf.get("architectures") or [])
    if model_type in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text") or "Qwen3Next" in arch:
        return "qwen3_next"
    if model_type == "llada2_moe" or "LLaDA2" in arch:
        return "llada2_moe"
    if model_type == "diffusion_gemma" or "DiffusionGemma" in arch:
        return "diffusion_gemma"  # uniform-noise canvases: convert_diffusion_gemma.py
    if model_type in ("qwen3_moe", "sdar_moe") or "Qwen3Moe" in arch or "SDARMoe" in arch:
        return "sdar_moe"
    if model_type in ("qwen3", "sdar") or "Qwen3" in arch or "SDAR" in arch:
        return "sdar"
    raise UserError(f"config.json: cannot tell the family from model_type {model_type!r} / "
                    f"architectures {arch!r}; pass --family one of {', '.join(FAMILIES)}")


def rope_scaling(rope: dict) -> RopeScaling | None:
    """A checkpoint's rope_parameters / rope_scaling as ours (None: plain rope); a kind we do
    not compute is refused by name."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    allowed = typing.get_args(RopeType)
    if kind not in allowed:
        raise UserError(f"config.json: rope_type {kind!r} is not supported; supported: default, "
                        f"{', '.join(allowed)}")

    def need(key: str):
        if rope.get(key) is None:
            raise UserError(f"config.json: rope_type {kind} needs '{key}' in its rope parameters")
        return rope[key]

    # Values go to RopeScaling as given: from_dict names a field of the wrong type or range.
    out = {"type": kind, "factor": need("factor")}
    if kind in ("yarn", "llama3"):
        out["original_max_len"] = need("original_max_position_embeddings")
    if kind == "yarn":
        if rope.get("attention_factor") is None and rope.get("mscale") and rope.get("mscale_all_dim"):
            raise UserError("config.json: yarn with mscale / mscale_all_dim is not supported; give "
                            "attention_factor instead")
        keys = ("beta_fast", "beta_slow", "attention_factor", "truncate")
    else:
        keys = ("low_freq_factor", "high_freq_factor") if kind == "llama3" else ()
    out.update({k: rope[k] for k in keys if rope.get(k) is not None})
    return from_dict(RopeScaling, out, where="config.json rope parameters")


def text_config(hf: dict) -> dict:
    """A multimodal checkpoint's text model config (Qwen3.5's nested `text_config`), with the
    top level's token ids where the text config leaves them out; a text-only config as it is."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    ids = ("eos_token_id", "pad_token_id", "mask_token_id", "tie_word_embeddings", *BLOCK_SIZE_KEYS,
           "block_mode")
    return {**{k: hf[k] for k in ids if k in hf}, **text}


def sequence_module(hf: dict, block_size: int, block_mode: str | None) -> SequenceModule:
    """The linear-attention layers a Qwen3-Next / Qwen3.5 config describes, read in `block_mode`
    (--block-mode, else config.json's block_mode: never a guess, the two read a block
    differently)."""
    mode = block_mode or hf.get("block_mode")
    if mode is None:
        raise UserError("config.json states no block_mode for the linear-attention layers; pass "
                        f"--block-mode ({' or '.join(typing.get_args(BlockMode))})")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # every full_attention_interval-th layer is attention
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    chunk = block_size * max(1, 64 // block_size)  # the reference's chunk of 64, in whole blocks
    return from_dict(SequenceModule, {
        "type": "gated_deltanet", "block_mode": mode, "layer_types": list(types),
        "num_key_heads": hf.get("linear_num_key_heads"),
        "num_value_heads": hf.get("linear_num_value_heads"),
        "key_head_dim": hf.get("linear_key_head_dim"),
        "value_head_dim": hf.get("linear_value_head_dim"),
        "conv_kernel": hf.get("linear_conv_kernel_dim"), "chunk_size": chunk},
        where="config.json linear attention")


def model_config(hf: dict, family: str, name: str, dtype: str, mask_token_id: int,
                 eos_ids: list[int], block_size: int, block_mode: str | None = None) -> ModelConfig:
    def need(key: str):
        if key not in hf:
            raise UserError(f"config.json: missing '{key}' (needed for family {family})")
        return hf[key]

    # transformers >= 5 nests rope settings under rope_parameters and says num_local_experts.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if "num_experts" not in hf and "num_local_experts" in hf:
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    if family == "qwen3_next" and "intermediate_size" not in hf:
        # Qwen3.5-MoE states no dense MLP width: every layer is MoE (checked below)
        hf = {**hf, "intermediate_size": need("moe_intermediate_size")}
    d, heads = need("hidden_size"), need("num_attention_heads")
    common = dict(
        name=name, vocab_size=need("vocab_size"), hidden_size=d,
        num_layers=need("num_hidden_layers"), num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or d // heads,
        intermediate_size=need("intermediate_size"),
        rope_theta=float(theta), rope_scaling=rope_scaling(rope),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 4096)) // block_size * block_size,
        block_size=block_size, mask_token_id=mask_token_id, eos_token_ids=tuple(eos_ids),
        pad_token_id=hf.get("pad_token_id") if isinstance(hf.get("pad_token_id"), int) else eos_ids[0],
        param_dtype=dtype, compute_dtype=dtype, init="checkpoint", qk_norm=True,
        attention_chunk=128,  # keys per attention chunk: a runtime setting (--attention-chunk)
    )
    if family == "sdar":
        return ModelConfig(**common, num_experts=0, chat_template="qwen")
    if family == "qwen3_next":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise UserError("config.json: only all-MoE Qwen3-Next layouts are supported "
                            "(decoder_sparse_step 1, no mlp_only_layers)")
        f, shared = need("moe_intermediate_size"), need("shared_expert_intermediate_size")
        if shared % f:
            raise UserError(f"config.json: shared_expert_intermediate_size {shared} is not a "
                            f"multiple of moe_intermediate_size {f}")
        return ModelConfig(
            **common, num_experts=need("num_experts"), num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=f, num_shared_experts=shared // f, shared_expert_gate=True,
            router="softmax_topk", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            rotary_fraction=float(partial), attention_output_gate=True, norm_weight_offset=True,
            sequence_module=sequence_module(hf, block_size, block_mode), moe_impl="auto",
            chat_template="qwen")
    if family == "sdar_moe":
        sparse_step = hf.get("decoder_sparse_step", 1)
        if sparse_step != 1 or hf.get("mlp_only_layers"):
            raise UserError("config.json: only all-MoE Qwen3-MoE layouts are supported "
                            "(decoder_sparse_step 1, no mlp_only_layers)")
        return ModelConfig(**common, num_experts=need("num_experts"),
                           num_experts_per_tok=need("num_experts_per_tok"),
                           moe_intermediate_size=need("moe_intermediate_size"),
                           router="softmax_topk", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                           moe_impl="auto", chat_template="qwen")
    # LLaDA2.2's block routing: `expert_capacity` experts per diffusion block (the window)
    pool = int(hf.get("expert_capacity") or 0)
    if pool and not need("num_experts_per_tok") <= pool <= need("num_experts"):
        raise UserError(f"config.json: expert_capacity {pool} must be in [num_experts_per_tok, "
                        f"num_experts] = [{hf['num_experts_per_tok']}, {hf['num_experts']}]")
    return ModelConfig(
        **{**common, "qk_norm": bool(hf.get("use_qk_norm", True))}, chat_template="llada2",
        router_block_pool=pool,
        first_k_dense=int(hf.get("first_k_dense_replace", 0)),
        num_experts=need("num_experts"), num_experts_per_tok=need("num_experts_per_tok"),
        moe_intermediate_size=need("moe_intermediate_size"),
        num_shared_experts=int(hf.get("num_shared_experts", 0) or 0), router="sigmoid_grouped",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), n_group=int(hf.get("n_group", 1) or 1),
        topk_group=int(hf.get("topk_group", 1) or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        rotary_fraction=float(partial), moe_impl="auto")


# ---------------------------------------------------------------------------- name mapping
Assign = Callable[[np.ndarray], None]


TEXT_MODEL = "model.language_model."  # a multimodal checkpoint's text model (Qwen3.5)
SKIPPED = ("model.visual.", "mtp.")  # its vision tower, multi-token-prediction heads: not converted


def _plan(cfg: ModelConfig, family: str, names: set[str]) -> Iterator[tuple[str, tuple, Callable]]:
    """(hf tensor name, our param path, transform hf array -> our array) for every tensor."""
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    llada = family == "llada2_moe"
    model = TEXT_MODEL if any(n.startswith(TEXT_MODEL) for n in names) else "model."
    yield (f"{model}word_embeddings.weight" if llada else f"{model}embed_tokens.weight"), ("embed",), None
    yield f"{model}norm.weight", ("final_norm",), None
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head",), np.transpose
    q_t = lambda w: w.T.reshape(d, h, dh)  # noqa: E731  [H*Dh, D] -> [D, H, Dh]
    kv_t = lambda w: w.T.reshape(d, k, dh)  # noqa: E731
    o_t = lambda w: w.T.reshape(h, dh, d)  # noqa: E731  [D, H*Dh] -> [H, Dh, D]
    for i in range(cfg.num_layers):
        p, ours = f"{model}layers.{i}", f"layer_{i}"
        yield f"{p}.input_layernorm.weight", (ours, "input_norm"), None
        yield f"{p}.post_attention_layernorm.weight", (ours, "post_attn_norm"), None
        if cfg.layer_type(i) == "linear_attention":
            yield from _linear_attention(cfg, f"{p}.linear_attn", (ours, "linear_attn"), names)
        elif cfg.attention_output_gate:  # q_proj holds [query; gate] per head
            a = f"{p}.self_attn"
            q_gate = lambda w: w.reshape(h, 2, dh, d).transpose(1, 3, 0, 2)  # noqa: E731 [2, D, H, Dh]
            yield f"{a}.q_proj.weight", (ours, "attn", "q_proj"), lambda w: q_gate(w)[0]
            yield f"{a}.q_proj.weight", (ours, "attn", "gate_proj"), lambda w: q_gate(w)[1]
            yield f"{a}.k_proj.weight", (ours, "attn", "k_proj"), kv_t
            yield f"{a}.v_proj.weight", (ours, "attn", "v_proj"), kv_t
            yield f"{a}.o_proj.weight", (ours, "attn", "o_proj"), o_t
            yield f"{a}.q_norm.weight", (ours, "attn", "q_norm"), None
            yield f"{a}.k_norm.weight", (ours, "attn", "k_norm"), None
        elif llada:
            a = f"{p}.attention"
            qkv = f"{a}.query_key_value.weight"
            yield qkv, (ours, "attn", "q_proj"), lambda w: q_t(w[: h * dh])
            yield qkv, (ours, "attn", "k_proj"), lambda w: kv_t(w[h * dh: (h + k) * dh])
            yield qkv, (ours, "attn", "v_proj"), lambda w: kv_t(w[(h + k) * dh:])
            yield f"{a}.dense.weight", (ours, "attn", "o_proj"), o_t
            if cfg.qk_norm:
                yield f"{a}.query_layernorm.weight", (ours, "attn", "q_norm"), None
                yield f"{a}.key_layernorm.weight", (ours, "attn", "k_norm"), None
        else:
            a = f"{p}.self_attn"
            yield f"{a}.q_proj.weight", (ours, "attn", "q_proj"), q_t
            yield f"{a}.k_proj.weight", (ours, "attn", "k_proj"), kv_t
            yield f"{a}.v_proj.weight", (ours, "attn", "v_proj"), kv_t
            yield f"{a}.o_proj.weight", (ours, "attn", "o_proj"), o_t
            yield f"{a}.q_norm.weight", (ours, "attn", "q_norm"), None
            yield f"{a}.k_norm.weight", (ours, "attn", "k_norm"), None
        m = f"{p}.mlp"
        if not cfg.is_moe_layer(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{m}.{proj}.weight", (ours, "mlp", proj), np.transpose
            continue
        yield f"{m}.gate.weight", (ours, "moe", "router"), np.transpose
        if cfg.router == "sigmoid_grouped":
            yield f"{m}.gate.expert_bias", (ours, "moe", "expert_bias"), None
        yield from _experts(cfg, m, ours, names)
        if cfg.num_shared_experts:
            shared = f"{m}.shared_expert" if cfg.shared_expert_gate else f"{m}.shared_experts"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{shared}.{proj}.weight", (ours, "moe", "shared", proj), np.transpose
        if cfg.shared_expert_gate:
            yield f"{m}.shared_expert_gate.weight", (ours, "moe", "shared_gate"), lambda w: w[0]


def _linear_attention(cfg: ModelConfig, src: str, ours: tuple, names: set[str]):
    """A Gated DeltaNet layer: Qwen3-Next's projections grouped per key head (in_proj_qkvz: for
    each key head, its q, k, then its value heads' v and z; in_proj_ba: its b, then its a), or
    Qwen3.5's separate ones (in_proj_qkv: all q heads, all k heads, all v heads; in_proj_z, _b,
    _a)."""
    sm = cfg.sequence_module
    d, hk, hv, dk, dv = (cfg.hidden_size, sm.num_key_heads, sm.num_value_heads, sm.key_head_dim,
                         sm.value_head_dim)
    per = hv // hk  # value heads per key head
    heads = lambda w, n, dim: w.reshape(n, dim, d).transpose(2, 0, 1)  # noqa: E731 [n*dim, D] -> [D, n, dim]
    if f"{src}.in_proj_qkvz.weight" in names:
        qkvz = f"{src}.in_proj_qkvz.weight"
        group = lambda w: w.reshape(hk, 2 * dk + 2 * per * dv, d)  # noqa: E731
        cut = (0, dk, 2 * dk, 2 * dk + per * dv, 2 * dk + 2 * per * dv)
        for name, (lo, hi), n, dim in (("q_proj", cut[0:2], hk, dk), ("k_proj", cut[1:3], hk, dk),
                                       ("v_proj", cut[2:4], hv, dv), ("z_proj", cut[3:5], hv, dv)):
            yield qkvz, (*ours, name), lambda w, lo=lo, hi=hi, n=n, dim=dim: heads(
                group(w)[:, lo:hi].reshape(n * dim, d), n, dim)
        ba = f"{src}.in_proj_ba.weight"
        yield ba, (*ours, "b_proj"), lambda w: w.reshape(hk, 2, per, d)[:, 0].reshape(hv, d).T
        yield ba, (*ours, "a_proj"), lambda w: w.reshape(hk, 2, per, d)[:, 1].reshape(hv, d).T
    else:
        qkv = f"{src}.in_proj_qkv.weight"
        cut = (0, hk * dk, 2 * hk * dk, 2 * hk * dk + hv * dv)
        for name, (lo, hi), n, dim in (("q_proj", cut[0:2], hk, dk), ("k_proj", cut[1:3], hk, dk),
                                       ("v_proj", cut[2:4], hv, dv)):
            yield qkv, (*ours, name), lambda w, lo=lo, hi=hi, n=n, dim=dim: heads(w[lo:hi], n, dim)
        yield f"{src}.in_proj_z.weight", (*ours, "z_proj"), lambda w: heads(w, hv, dv)
        yield f"{src}.in_proj_b.weight", (*ours, "b_proj"), np.transpose
        yield f"{src}.in_proj_a.weight", (*ours, "a_proj"), np.transpose
    # conv1d [C, 1, W] over the channels [q heads; k heads; v heads] -> [W, heads, dim] each
    conv = f"{src}.conv1d.weight"
    cut = (0, hk * dk, 2 * hk * dk, 2 * hk * dk + hv * dv)
    for name, (lo, hi), n, dim in (("conv_q", cut[0:2], hk, dk), ("conv_k", cut[1:3], hk, dk),
                                   ("conv_v", cut[2:4], hv, dv)):
        yield conv, (*ours, name), lambda w, lo=lo, hi=hi, n=n, dim=dim: \
            w[lo:hi, 0].T.reshape(-1, n, dim)
    yield f"{src}.A_log", (*ours, "A_log"), None
    yield f"{src}.dt_bias", (*ours, "dt_bias"), None
    yield f"{src}.norm.weight", (*ours, "norm"), None
    yield f"{src}.out_proj.weight", (*ours, "out_proj"), lambda w: w.T.reshape(hv, dv, d)


def _experts(cfg: ModelConfig, m: str, ours: str, names: set[str]):
    """Per-expert tensors, stacked [E, ...] tensors, or fused gate_up (transformers >= 5)."""
    f = cfg.moe_intermediate_size
    if f"{m}.experts.gate_up_proj" in names:  # [E, 2F, D] (gate then up), down [E, D, F]
        yield f"{m}.experts.gate_up_proj", (ours, "moe", "experts_gate"), lambda w: np.swapaxes(w[:, :f], 1, 2)
        yield f"{m}.experts.gate_up_proj", (ours, "moe", "experts_up"), lambda w: np.swapaxes(w[:, f:], 1, 2)
        yield f"{m}.experts.down_proj", (ours, "moe", "experts_down"), lambda w: np.swapaxes(w, 1, 2)
        return
    if f"{m}.experts.gate_proj" in names:  # stacked nn.Linear weights: [E, F, D], down [E, D, F]
        for proj, ours_name in (("gate_proj", "experts_gate"), ("up_proj", "experts_up"),
                                ("down_proj", "experts_down")):
            yield f"{m}.experts.{proj}", (ours, "moe", ours_name), lambda w: np.swapaxes(w, 1, 2)
        return
    for e in range(cfg.num_experts):
        for proj, ours_name in (("gate_proj", "experts_gate"), ("up_proj", "experts_up"),
                                ("down_proj", "experts_down")):
            yield f"{m}.experts.{e}.{proj}.weight", (ours, "moe", ours_name, e), np.transpose


# ---------------------------------------------------------------------------- driver
def _special_ids(src: pathlib.Path, hf: dict, mask_token_id: int | None) -> tuple[int, list[int]]:
    tok = None
    if (src / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if mask_token_id is None:
        mask_token_id = hf.get("mask_token_id")
        for t in MASK_TOKENS:
            if mask_token_id is None and tok is not None and tok.token_to_id(t) is not None:
                mask_token_id = tok.token_to_id(t)
    if mask_token_id is None:
        raise UserError("no mask token id in config.json or the tokenizer; pass --mask-token-id N")
    eos = hf.get("eos_token_id")
    if eos is None and (src / "generation_config.json").is_file():
        eos = json.loads((src / "generation_config.json").read_text()).get("eos_token_id")
    if eos is None:
        raise UserError("config.json has no eos_token_id")
    return int(mask_token_id), [int(e) for e in (eos if isinstance(eos, list) else [eos])]


# A checkpoint's block-diffusion decoding defaults, where its generation_config.json states
# them: the LLaDA2.1 / 2.2 generate() argument names, and SGLang's. Each maps to a DecodeConfig
# field; a stated editing threshold turns edit mode on (indel on a model with edit actions).
DIFFUSION_GENERATION_KEYS = {
    "threshold": "accept_threshold",
    "editing_threshold": "edit_threshold", "edit_threshold": "edit_threshold",
    "max_post_steps": "max_post_edit_steps", "max_post_edit_steps": "max_post_edit_steps",
}


EDIT_OP_KEYS = ("delete_token_id", "split_token_id")  # Levenshtein editing's action ids


def edit_op_ids(src: pathlib.Path, hf: dict) -> dict[str, int]:
    """The delete / split ids config.json (else generation_config.json) states: both or none."""
    found = {k: hf[k] for k in EDIT_OP_KEYS if isinstance(hf.get(k), int)}
    path = src / "generation_config.json"
    if not found and path.is_file():
        gen = json.loads(path.read_text())
        found = {k: gen[k] for k in EDIT_OP_KEYS if isinstance(gen.get(k), int)}
    if len(found) == 1:
        raise UserError(f"config.json states {next(iter(found))} but not "
                        f"{next(k for k in EDIT_OP_KEYS if k not in found)}: Levenshtein "
                        "editing needs both")
    return found


def generation_settings_from_hf(src: pathlib.Path, edit_ops: bool = False) -> dict[str, Any]:
    """The decoding defaults a Hugging Face generation_config.json states, as generation.yaml's
    `decoding` section ({} when it states none). Sampling: with `do_sample: true`, the
    temperature, top_k and top_p that transformers would use (its defaults 1.0, 50 and 1.0 where
    the file is silent); else greedy (mbd-jax's default). Block diffusion: the keys of
    DIFFUSION_GENERATION_KEYS; `edit_ops`: the model has delete / split ids."""
    path = src / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(gen, dict):
        return {}
    decoding: dict[str, Any] = {}
    if gen.get("do_sample") is True:
        decoding = {"temperature": gen.get("temperature", 1.0), "top_k": gen.get("top_k", 50),
                    "top_p": gen.get("top_p", 1.0)}
    for key, field in DIFFUSION_GENERATION_KEYS.items():
        if gen.get(key) is not None:
            decoding[field] = gen[key]
    if "edit_threshold" in decoding:
        decoding["sampling_mode"] = "indel" if edit_ops else "edit"
    try:
        from_dict(DecodeConfig, decoding, where=f"{path}")
    except ConfigError as e:
        log.warning("not carrying the decoding settings over: %s", e)
        return {}
    return {"decoding": decoding} if decoding else {}


BLOCK_SIZE_KEYS = ("block_size", "block_length", "bd_size")  # where checkpoints state it


def source_block_size(hf: dict, given: int | None) -> int:
    """The diffusion block size: --block-size, else the checkpoint's config; never a guess (a
    model decoded with the wrong block is silently wrong)."""
    stated = next((hf[k] for k in BLOCK_SIZE_KEYS if isinstance(hf.get(k), int)), None)
    if given is not None:
        if stated is not None and stated != given:
            log.warning("--block-size %d differs from config.json's %d; using %d", given, stated,
                        given)
        return given
    if stated is None:
        raise UserError("config.json states no diffusion block size (none of "
                        f"{', '.join(BLOCK_SIZE_KEYS)}); pass --block-size (LLaDA2.x: 32; SDAR: "
                        "the b<N> in the model's name)")
    return stated


def convert(src: str | pathlib.Path, dst: str | pathlib.Path, *, family: str = "auto",
            dtype: str = "bfloat16", mask_token_id: int | None = None,
            block_size: int | None = None, block_mode: str | None = None,
            quantization: str = "none", progress: bool = True) -> dict[str, Any]:
    """Converts a Hugging Face checkpoint directory; returns the manifest. `dtype` is the
    parameters' and the compute dtype (change compute_dtype at load with --compute-dtype);
    `quantization` stores the weight matrices in 8 bits (model/quantize.py)."""
    import jax
    import ml_dtypes

    from mbd_jax.model import layout
    from mbd_jax.model.quantize import quantize_tree
    from mbd_jax.model.transformer import param_shapes

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if _is_diffusion_gemma(src, family):
        from mbd_jax import convert_diffusion_gemma

        if quantization != "none":
            raise UserError(f"--quantize {quantization}: not yet for family diffusion_gemma")
        return convert_diffusion_gemma.convert(src, dst, dtype=dtype, progress=progress)
    family, cfg = _source_config(src, family, dtype, mask_token_id, block_size, block_mode)
    source = TensorSource(src)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    t0 = time.perf_counter()
    params = _read_params(source, cfg, family, np_dtype, progress)
    read_s = time.perf_counter() - t0
    n_params = int(sum(a.size for a in jax.tree.leaves(params)))
    cfg = _write_beside(src, dst, cfg)
    if quantization != "none":
        cfg = dataclasses.replace(cfg, quantization=quantization)
        params = quantize_tree(params, param_shapes(layout.canonical(cfg)))
    _to_device_in_place(params)  # orbax would otherwise copy every numpy leaf at once
    save_model(dst, cfg, params, canonical=True)
    return write_manifest(dst, {
        "converter_version": CONVERTER_VERSION, "source": str(src.resolve()), "family": family,
        "dtype": dtype, "quantization": quantization, "parameters": n_params,
        "seconds_reading": round(read_s, 3), "source_bytes": source.nbytes()})


def _is_diffusion_gemma(src: pathlib.Path, family: str) -> bool:
    if family != "auto":
        return family == "diffusion_gemma"
    return (src / "config.json").is_file() and detect_family(
        json.loads((src / "config.json").read_text())) == "diffusion_gemma"


def _source_config(src: pathlib.Path, family: str, dtype: str, mask_token_id: int | None,
                   block_size: int | None, block_mode: str | None) -> tuple[str, ModelConfig]:
    """(the family, the model config) a checkpoint's config.json gives."""
    if not src.is_dir():
        raise UserError(f"--src {src}: no such directory (a Hugging Face checkpoint directory "
                        "with config.json and its weights)")
    if not (src / "config.json").is_file():
        raise UserError(f"--src {src}: no config.json (a Hugging Face checkpoint directory has "
                        "one beside its weights)")
    hf = json.loads((src / "config.json").read_text())
    family = detect_family(hf) if family == "auto" else family
    hf = text_config(hf)
    if family not in FAMILIES:
        raise UserError(f"--family {family!r}: expected auto or one of {', '.join(FAMILIES)}")
    mask_id, eos_ids = _special_ids(src, hf, mask_token_id)
    block_size = source_block_size(hf, block_size)
    try:
        cfg = model_config(hf, family, src.name, dtype, mask_id, eos_ids, block_size, block_mode)
        cfg = dataclasses.replace(cfg, **edit_op_ids(src, hf))
        cfg.validate("converted config")
    except ConfigError as e:
        raise UserError(f"config.json does not give a valid model: {e}") from None
    return family, cfg


def _read_params(source: TensorSource, cfg: ModelConfig, family: str, np_dtype: np.dtype,
                 progress: bool) -> dict:
    """Every parameter of `cfg` (canonical layout, host arrays of `np_dtype`), preallocated from
    the model definition and filled tensor by tensor; a tensor of the wrong shape, a parameter
    no tensor fills and a tensor no parameter takes are each a UserError."""
    import jax
    from tqdm import tqdm

    from mbd_jax.model import layout
    from mbd_jax.model.transformer import param_shapes

    params = jax.tree.map(lambda s: np.empty(s.shape, np_dtype),
                          param_shapes(layout.canonical(cfg)))
    seen = {k: False for k in _paths(params)}
    used = set()
    total = sum(a.nbytes for a in jax.tree.leaves(params))  # bytes written, in the target dtype
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    last_name, last = None, None
    for hf_name, path, fn in _plan(cfg, family, set(source.names)):
        if hf_name != last_name:  # the fused qkv is read once for q, k and v
            last_name, last = hf_name, source.get(hf_name)
            used.add(hf_name)
        target_path, index = (path[:-1], path[-1]) if isinstance(path[-1], int) else (path, None)
        target = _get(params, target_path)
        want = target.shape if index is None else target.shape[1:]
        try:
            value = last if fn is None else fn(last)
        except ValueError:  # a reshape of the wrong number of elements
            value = None
        if value is None or value.shape != want:
            raise UserError(f"tensor '{hf_name}' has shape {list(last.shape)}, which does not give "
                            f"{'/'.join(map(str, path))} {list(want)} (config.json and the weights "
                            "disagree)")
        bar.update(value.size * np_dtype.itemsize)
        if index is None:
            target[...] = value
        else:
            target[index] = value
        seen[target_path] = True
    bar.close()
    missing = [k for k, v in seen.items() if not v]
    if missing:
        raise UserError(f"no checkpoint tensor fills parameter {'/'.join(missing[0])}")
    skipped = {n for n in source.names if "rotary_emb" in n or n.startswith(SKIPPED)}
    if any(n.startswith(SKIPPED) for n in skipped):
        log.info("not converted (the text model only): %d tensors under %s", len(skipped),
                 " / ".join(SKIPPED))
    unused = sorted(set(source.names) - used - skipped)
    if unused:
        raise UserError(f"checkpoint tensor '{unused[0]}' (and {len(unused) - 1} more) is not used "
                        f"by family {family}: wrong --family?")
    return params


def _write_beside(src: pathlib.Path, dst: pathlib.Path, cfg: ModelConfig) -> ModelConfig:
    """Copies the tokenizer files and writes the sampling defaults into `dst`; returns `cfg`
    naming the tokenizer it found."""
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer_name = None
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            if name == "tokenizer.json":
                tokenizer_name = name
    settings = generation_settings_from_hf(src, edit_ops=bool(cfg.edit_op_ids))
    if settings:
        (dst / GENERATION_FILE).write_text(
            "# Decoding defaults from the source's generation_config.json (mbd-jax convert);\n"
            "# settings, outside manifest.json's checksums: tune them here.\n"
            + yaml.safe_dump(settings, sort_keys=False))
    return dataclasses.replace(cfg, tokenizer=tokenizer_name)


def _paths(tree: dict, prefix: tuple = ()) -> Iterator[tuple]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))
        else:
            yield prefix + (k,)


def _to_device_in_place(tree: dict) -> None:
    """Replaces numpy leaves by device arrays one at a time, freeing each numpy copy as it goes."""
    import jax

    for k, v in tree.items():
        if isinstance(v, dict):
            _to_device_in_place(v)
        else:
            tree[k] = jax.device_put(v)


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree
