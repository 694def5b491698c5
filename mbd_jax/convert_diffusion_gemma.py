"""A transformers DiffusionGemma checkpoint (config.json, generation_config.json, safetensors) as
mbd-jax's DiffusionGemmaConfig, CanvasDecoding defaults and parameter tree
(model/diffusion_gemma.py).

The checkpoint keeps the weights both passes share under `model.decoder.*` and the encoder's own
residual scales under `model.encoder.language_model.layers.N.layer_scalar` (both sets are kept:
they differ). The vision tower (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`)
is not converted: mbd-jax serves the text model. `lm_head` is the tied embedding.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np

from mbd_jax.config.diffusion_gemma import CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.errors import UserError

DECODER = "model.decoder."
ENCODER_LAYERS = "model.encoder.language_model.layers."
SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")
NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
         "pre_feedforward_layernorm": "pre_ffn_norm", "post_feedforward_layernorm": "post_ffn_norm",
         "post_feedforward_layernorm_1": "post_ffn_norm_1",
         "post_feedforward_layernorm_2": "post_ffn_norm_2",
         "pre_feedforward_layernorm_2": "pre_ffn_norm_2"}


def config_from_hf(hf: dict, name: str, dtype: str = "float32") -> DiffusionGemmaConfig:
    """config.json (its text_config) -> DiffusionGemmaConfig; a setting mbd-jax does not compute
    is refused by name."""
    text = hf.get("text_config", hf)

    def need(key: str):
        if text.get(key) is None:
            raise UserError(f"config.json: text_config has no '{key}'")
        return text[key]

    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(f"config.json: hidden_activation {text['hidden_activation']!r} is not "
                        "supported (gelu_pytorch_tanh)")
    if text.get("use_bidirectional_attention") == "all":
        raise UserError("config.json: use_bidirectional_attention 'all' (a bidirectional "
                        "encoder) is not supported")
    n = need("num_hidden_layers")
    types = list(text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"  # transformers forces it
    rope = text.get("rope_parameters") or {}
    sliding, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
    for kind, params, want in (("sliding_attention", sliding, "default"),
                               ("full_attention", full, "proportional")):
        if params.get("rope_type", want) != want or params.get("factor", 1.0) != 1.0:
            raise UserError(f"config.json: rope_parameters.{kind} {params} is not supported "
                            f"(rope_type {want}, no factor)")
    # the global layers' heads: per_layer_config (what transformers writes), else the keys it
    # reads them from (global_head_dim, num_global_key_value_heads)
    overrides = {json.dumps(v, sort_keys=True) for k, v in (text.get("per_layer_config") or {}).items()
                 if types[int(k)] == "full_attention"}
    if len(overrides) > 1:
        raise UserError("config.json: per_layer_config gives the global layers different shapes")
    glob = json.loads(overrides.pop()) if overrides else {}
    global_head_dim = glob.get("head_dim", text.get("global_head_dim", 512))
    global_kv = glob.get("num_key_value_heads", text.get("num_global_key_value_heads")
                         or text.get("num_key_value_heads"))
    eos = text.get("eos_token_id", hf.get("eos_token_id", 1))
    cfg = DiffusionGemmaConfig(
        name=name, vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), num_layers=n,
        num_heads=need("num_attention_heads"), num_kv_heads=need("num_key_value_heads"),
        head_dim=need("head_dim"), sliding_window=need("sliding_window"),
        rope_theta=float(sliding.get("rope_theta", 10_000.0)),
        num_global_kv_heads=int(global_kv), global_head_dim=int(global_head_dim),
        global_rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        global_rope_fraction=float(full.get("partial_rotary_factor", 0.25)),
        layer_types=tuple(types), num_experts=need("num_experts"),
        num_experts_per_tok=need("top_k_experts"),
        moe_intermediate_size=need("moe_intermediate_size"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        final_logit_softcap=float(text.get("final_logit_softcapping") or 30.0),
        canvas_length=int(hf.get("canvas_length") or 256),
        max_seq_len=int(text.get("max_position_embeddings", 4096)),
        pad_token_id=int(text.get("pad_token_id") or 0),
        eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
        dtype=dtype)
    cfg.validate("config.json")
    return cfg


def decoding_from_hf(gen: dict) -> CanvasDecoding:
    """generation_config.json's denoising settings (transformers' names) as CanvasDecoding."""
    d = CanvasDecoding()
    sampler = gen.get("sampler_config") or {}
    fields = {"steps": gen.get("max_denoising_steps"),
              "entropy_bound": sampler.get("entropy_bound"), "t_min": gen.get("t_min"),
              "t_max": gen.get("t_max"), "stability": gen.get("stability_threshold"),
              "confidence": gen.get("confidence_threshold")}
    out = CanvasDecoding(**{k: (getattr(d, k) if v is None else type(getattr(d, k))(v))
                            for k, v in fields.items()})
    out.validate("generation_config.json")
    return out


def params_from_hf(get: Callable[[str], np.ndarray], names: set[str],
                   cfg: DiffusionGemmaConfig) -> dict:
    """The parameter tree from a checkpoint's tensors (`get(name)`, `names`: every tensor it
    holds). Linear weights [out, in] become [in, out]; gate_up_proj [E, 2F, D] splits into gate
    and up [E, D, F] (gate rows first), down_proj [E, D, F] becomes [E, F, D]. A tensor no
    parameter takes (outside the vision tower) is an error: the wrong checkpoint."""
    used: set[str] = set()
    dtype = np.dtype("float32") if cfg.dtype == "float32" else None

    def t(name: str, transpose: bool = False) -> np.ndarray:
        if name not in names:
            raise UserError(f"checkpoint is missing tensor '{name}'")
        used.add(name)
        a = np.asarray(get(name))
        a = a.T if transpose else a
        return a.astype(dtype) if dtype is not None else a

    def linear(prefix: str, names_: dict[str, str]) -> dict:
        return {ours: t(f"{prefix}{theirs}_proj.weight", transpose=True)
                for ours, theirs in names_.items()}

    layers = []
    for i in range(cfg.num_layers):
        p = f"{DECODER}layers.{i}."
        attn = linear(p + "self_attn.", {"q": "q", "k": "k", "o": "o"})
        if cfg.layer_types[i] == "sliding_attention":
            attn["v"] = t(p + "self_attn.v_proj.weight", transpose=True)
        attn.update(q_norm=t(p + "self_attn.q_norm.weight"), k_norm=t(p + "self_attn.k_norm.weight"))
        gate_up = t(p + "experts.gate_up_proj")  # [E, 2F, D]
        f = cfg.moe_intermediate_size
        layer = {ours: t(f"{p}{theirs}.weight") for theirs, ours in NORMS.items()}
        layer.update(
            attn=attn, mlp=linear(p + "mlp.", {"gate": "gate", "up": "up", "down": "down"}),
            router={"proj": t(p + "router.proj.weight", transpose=True),
                    "scale": t(p + "router.scale"), "expert_scale": t(p + "router.per_expert_scale")},
            experts={"gate": gate_up[:, :f].transpose(0, 2, 1), "up": gate_up[:, f:].transpose(0, 2, 1),
                     "down": t(p + "experts.down_proj").transpose(0, 2, 1)},
            scalar=np.concatenate([t(p + "layer_scalar"), t(f"{ENCODER_LAYERS}{i}.layer_scalar")]))
        layers.append(layer)
    sc = f"{DECODER}self_conditioning."
    params = {"embed": t(DECODER + "embed_tokens.weight"), "norm": t(DECODER + "norm.weight"),
              "self_conditioning": {"pre_norm": t(sc + "pre_norm.weight"),
                                    **linear(sc, {"gate": "gate", "up": "up", "down": "down"})},
              "layers": layers}
    # the encoder's copies of the shared weights (a checkpoint that did not tie them) add nothing
    rest = {n for n in names - used
            if not n.startswith(SKIPPED) and not n.startswith("model.encoder.language_model.")}
    if rest:
        raise UserError(f"checkpoint tensor '{sorted(rest)[0]}' (and {len(rest) - 1} more) is "
                        "not a DiffusionGemma text-model tensor")
    return params


def convert(src, dst, *, dtype: str = "bfloat16", progress: bool = True) -> dict:
    """A transformers DiffusionGemma checkpoint directory -> an mbd-jax model directory
    (canvas_model.py); returns its manifest. `progress` is accepted for the CLI's signature (the
    tensors are read one at a time, like convert.py's)."""
    import pathlib
    import shutil
    import time

    from mbd_jax import canvas_model
    from mbd_jax.checkpoint import write_manifest
    from mbd_jax.hf_source import CONVERTER_VERSION, TOKENIZER_FILES, TensorSource

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    hf = json.loads((src / "config.json").read_text())
    cfg = config_from_hf(hf, src.name, dtype)
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    decoding = decoding_from_hf(gen)
    eos = gen.get("eos_token_id")  # EOS / pad as the generation config states them
    if eos is not None:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
    if isinstance(gen.get("pad_token_id"), int):
        cfg = dataclasses.replace(cfg, pad_token_id=gen["pad_token_id"])
    cfg.validate("config.json")
    source = TensorSource(src)
    t0 = time.perf_counter()
    params = params_from_hf(source.get, set(source.names), cfg)
    import jax
    import jax.numpy as jnp

    if dtype == "bfloat16":
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    read_s = time.perf_counter() - t0
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            tokenizer = "tokenizer.json" if name == "tokenizer.json" else tokenizer
    canvas_model.save(dst, cfg, params, decoding, tokenizer)
    n_params = int(sum(np.asarray(a).size for a in jax.tree.leaves(params)))
    return write_manifest(dst, {
        "converter_version": CONVERTER_VERSION, "source": str(src.resolve()),
        "family": canvas_model.FAMILY, "dtype": dtype, "quantization": "none",
        "parameters": n_params, "seconds_reading": round(read_s, 3),
        "source_bytes": source.nbytes()})

