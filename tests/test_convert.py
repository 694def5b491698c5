"""Checkpoint conversion against real `transformers` models and independent references."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mbd_jax.checkpoint import load_model
from mbd_jax.config import GENERATION_FILE, DecodeConfig, RopeScaling, model_generation_settings
from mbd_jax.convert import convert
from mbd_jax.engine import Engine
from mbd_jax.errors import ConfigError, UserError
from mbd_jax.model import layout
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.rope import frequencies
from mbd_jax.model.attention import Attention
from mbd_jax.model.transformer import MoE, Transformer, block_causal_mask
from tests.conftest import tiny_cfg

BLOCK = 4
MASK_ID = 1
EOS_ID = 2


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits and routing are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def hf_model(kind: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=50000.0,
                  max_position_embeddings=128, eos_token_id=EOS_ID, pad_token_id=0,
                  tie_word_embeddings=False, attn_implementation="eager")
    if kind == "qwen3-yarn":  # a pretraining context of 8 stretched 16x: positions past 8 matter
        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 16.0,
                                     "original_max_position_embeddings": 8}
        kind = "qwen3"
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=8,
                                                    num_experts_per_tok=2, norm_topk_prob=True))
    _randomise(model, seed)
    return model.eval()


# transformers' rope_parameters -> ours, on a partial rotary head (12 of 16 dims); plain rope is
# test_layers.py's NumPy reference
ROPE_SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", 4.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             RopeScaling("yarn", 4.0, original_max_len=64)),
    "yarn-beta-attention": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
         "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
        RopeScaling("yarn", 8.0, original_max_len=256, beta_fast=16.0, beta_slow=2.0,
                    attention_factor=1.3, truncate=False)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0},
               RopeScaling("llama3", 8.0, original_max_len=128)),
}


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_rope_frequencies_match_transformers(name):
    """Our scaled rope frequencies and cos/sin scale equal transformers' rope init functions'."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, ours = ROPE_SCALINGS[name]
    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
                     rope_parameters={**theirs, "rope_theta": 50000.0, "partial_rotary_factor": 0.75})
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[theirs["rope_type"]](hf, "cpu")
    cfg = tiny_cfg(head_dim=16, rotary_fraction=0.75, rope_theta=50000.0, rope_scaling=ours)
    freq, scale = frequencies(cfg)
    np.testing.assert_allclose(np.asarray(freq), want_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale)
    plain, _ = frequencies(tiny_cfg(head_dim=16, rotary_fraction=0.75, rope_theta=50000.0))
    assert not np.allclose(np.asarray(freq), np.asarray(plain))  # the scaling changes something


def test_rope_parameters_convert_or_are_refused_by_name():
    """Old (`rope_scaling` with `type`) and new (`rope_parameters` with `rope_type`) spellings map
    to the same settings; a kind we do not compute, or a missing parameter, is named."""
    from mbd_jax.convert import rope_scaling

    old = rope_scaling({"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768})
    new = rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                        "beta_fast": 32, "rope_theta": 1e6})
    assert old == new == RopeScaling("yarn", 4.0, original_max_len=32768)
    assert rope_scaling({"rope_type": "default", "rope_theta": 1e6}) is None and rope_scaling({}) is None
    with pytest.raises(UserError, match="rope_type 'dynamic' is not supported; supported: default, "
                                        "linear, yarn, llama3"):
        rope_scaling({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UserError, match="llama3 needs 'original_max_position_embeddings'"):
        rope_scaling({"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(UserError, match="field 'factor' must be a finite number, got '4'"):
        rope_scaling({"rope_type": "linear", "factor": "4"})
    with pytest.raises(UserError, match="'beta_fast' > 'beta_slow' > 0"):
        rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 1.0, "beta_slow": 32.0})


def torch_block_mask(n: int) -> torch.Tensor:
    """Additive float [1, 1, n, n] block-causal mask (0 visible, finfo.min hidden)."""
    pos = torch.arange(n)
    visible = pos[None, :] < (pos[:, None] // BLOCK + 1) * BLOCK
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        t = torch.tensor([ids])
        out = model(input_ids=t, attention_mask=torch_block_mask(len(ids)),
                    position_ids=torch.arange(len(ids))[None])
    return out.logits[0].numpy()


def torch_decode(model, prompt: list[int], max_new: int, threshold: float = 0.95) -> list[int]:
    """Reference SingleBD greedy decoding with full recomputation (no cache): the block holding the
    first new position is filled step by step (confidence > threshold, else top-1), then the next."""
    seq = list(prompt)
    limit = len(prompt) + max_new
    while len(seq) < limit:
        start = len(seq) // BLOCK * BLOCK
        end = start + BLOCK
        block = seq[start:] + [MASK_ID] * (end - len(seq))
        fixed = len(seq) - start
        while MASK_ID in block[fixed:min(BLOCK, limit - start)]:
            logits = torch_logits(model, seq[:start] + block)[start:end]
            logits[:, MASK_ID] = -np.inf
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            tok, conf = probs.argmax(-1), probs.max(-1)
            masked = [i for i in range(BLOCK) if block[i] == MASK_ID and start + i < limit]
            take = [i for i in masked if conf[i] > threshold] or [max(masked, key=lambda i: conf[i])]
            for i in take:
                block[i] = int(tok[i])
        seq = seq[:start] + block[: min(BLOCK, limit - start)]
        gen = seq[len(prompt):]
        if EOS_ID in gen:
            return gen[: gen.index(EOS_ID)]
    return seq[len(prompt):]


def ours_logits(loaded, ids: list[int]) -> np.ndarray:
    pos = jnp.arange(len(ids))[None]
    forward = jax.jit(lambda p, t: Transformer(loaded.cfg).apply(  # compiled: op by op is slower
        {"params": p}, t, ForwardMeta.explicit(pos, block_causal_mask(pos, BLOCK)))[0])
    return np.asarray(forward(loaded.params, jnp.asarray([ids]))[0])


@pytest.mark.parametrize("kind,save", [
    ("qwen3", "safetensors"), ("qwen3", "bin"), ("qwen3_moe", "safetensors"), ("qwen3_moe", "sharded"),
    ("qwen3-yarn", "safetensors")])
def test_qwen_family_matches_transformers(tmp_path, kind, save):
    model = hf_model(kind)
    src = tmp_path / "hf"
    kwargs = {"safe_serialization": save != "bin"}
    if save == "sharded":
        kwargs["max_shard_size"] = "40KB"
        # The source's sampling defaults travel into generation.yaml (top_k: transformers' 50)
        model.generation_config.update(do_sample=True, temperature=0.7, top_p=0.9)
    model.save_pretrained(src, **kwargs)
    if save == "sharded":
        assert (src / "model.safetensors.index.json").is_file()
    manifest = convert(src, tmp_path / "out", dtype="float32", mask_token_id=MASK_ID,
                       block_size=BLOCK, progress=False)
    assert manifest["family"] == ("sdar_moe" if kind == "qwen3_moe" else "sdar")
    settings = model_generation_settings(str(tmp_path / "out"))
    assert settings == ({"decoding": {"temperature": 0.7, "top_k": 50, "top_p": 0.9}}
                        if save == "sharded" else {})  # greedy sources need no file
    assert GENERATION_FILE not in manifest["files"]
    loaded = load_model(str(tmp_path / "out"))
    assert (loaded.cfg.rope_scaling is not None) == (kind == "qwen3-yarn")
    ids = list(np.random.default_rng(0).integers(3, 96, 22))
    diff = np.abs(ours_logits(loaded, ids) - torch_logits(model, ids)).max()
    assert diff <= 1e-4, diff
    # Greedy block-diffusion decoding: our engine (KV buffer, jitted loop) vs the torch loop.
    prompt = ids[:6]
    want = torch_decode(model, prompt, max_new=10)
    got = Engine(loaded.cfg, loaded.params, batch_size=1).generate(
        [prompt], DecodeConfig(max_new_tokens=10))[0].token_ids
    assert got == want and len(want) >= 1


# ---------------------------------------------------------------------------- LLaDA2
LLADA = dict(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
             num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, first_k_dense_replace=1, partial_rotary_factor=0.5,
             rope_theta=600000.0, rms_norm_eps=1e-6, max_position_embeddings=64, use_qk_norm=True,
             norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
             mask_token_id=MASK_ID, model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"])


def llada_state_dict(seed: int = 0, stacked: bool = False, c: dict = LLADA
                     ) -> dict[str, torch.Tensor]:
    """A seeded state dict with LLaDA2's real tensor names and layouts (config `c`)."""
    g = torch.Generator().manual_seed(seed)
    d, h, k, dh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    f, e = c["moe_intermediate_size"], c["num_experts"]
    w = lambda *shape: 0.15 * torch.randn(shape, generator=g)  # noqa: E731
    ones = lambda n: 1.0 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    sd = {"model.word_embeddings.weight": w(c["vocab_size"], d), "model.norm.weight": ones(d),
          "lm_head.weight": w(c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = ones(d)
        sd[f"{p}.post_attention_layernorm.weight"] = ones(d)
        sd[f"{p}.attention.query_key_value.weight"] = w((h + 2 * k) * dh, d)
        sd[f"{p}.attention.query_layernorm.weight"] = ones(dh)
        sd[f"{p}.attention.key_layernorm.weight"] = ones(dh)
        sd[f"{p}.attention.dense.weight"] = w(d, h * dh)
        if i < c["first_k_dense_replace"]:
            for proj, shape in (("gate_proj", (48, d)), ("up_proj", (48, d)), ("down_proj", (d, 48))):
                sd[f"{p}.mlp.{proj}.weight"] = w(*shape)
            continue
        sd[f"{p}.mlp.gate.weight"] = w(e, d)
        sd[f"{p}.mlp.gate.expert_bias"] = 0.1 * torch.rand(e, generator=g)  # >= 0: see test below
        if stacked:
            sd[f"{p}.mlp.experts.gate_proj"] = w(e, f, d)
            sd[f"{p}.mlp.experts.up_proj"] = w(e, f, d)
            sd[f"{p}.mlp.experts.down_proj"] = w(e, d, f)
        else:
            for j in range(e):
                sd[f"{p}.mlp.experts.{j}.gate_proj.weight"] = w(f, d)
                sd[f"{p}.mlp.experts.{j}.up_proj.weight"] = w(f, d)
                sd[f"{p}.mlp.experts.{j}.down_proj.weight"] = w(d, f)
        for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            sd[f"{p}.mlp.shared_experts.{proj}.weight"] = w(*shape)
    return sd


def write_llada(dirpath: pathlib.Path, sd: dict, config: dict = LLADA) -> pathlib.Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dirpath / "model.safetensors"))
    return dirpath


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llada")
    sd = llada_state_dict()
    convert(write_llada(tmp / "hf", sd), tmp / "out", dtype="float32", block_size=BLOCK, progress=False)
    return sd, load_model(str(tmp / "out"))


def test_llada2_moe_layer_matches_transformers_deepseek_v3(llada):
    """Sigmoid grouped routing with the selection bias, routed scaling and the shared expert,
    against transformers' DeepseekV3MoE loaded with the same weights. The bias is >= 0 so every
    selection score is positive: DeepseekV3 fills masked groups with 0, we with -inf."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    sd, loaded = llada
    c = LLADA
    ref = DeepseekV3MoE(DeepseekV3Config(
        hidden_size=c["hidden_size"], moe_intermediate_size=c["moe_intermediate_size"],
        n_routed_experts=c["num_experts"], num_experts_per_tok=c["num_experts_per_tok"],
        n_group=c["n_group"], topk_group=c["topk_group"], routed_scaling_factor=c["routed_scaling_factor"],
        norm_topk_prob=True, n_shared_experts=1)).eval()
    p, e = "model.layers.1.mlp", c["num_experts"]
    with torch.no_grad():
        ref.gate.weight.copy_(sd[f"{p}.gate.weight"])
        ref.gate.e_score_correction_bias.copy_(sd[f"{p}.gate.expert_bias"])
        ref.experts.gate_up_proj.copy_(torch.stack([torch.cat(
            [sd[f"{p}.experts.{j}.gate_proj.weight"], sd[f"{p}.experts.{j}.up_proj.weight"]]) for j in range(e)]))
        ref.experts.down_proj.copy_(torch.stack([sd[f"{p}.experts.{j}.down_proj.weight"] for j in range(e)]))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(ref.shared_experts, proj).weight.copy_(sd[f"{p}.shared_experts.{proj}.weight"])
    x = torch.randn(2, 9, c["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(x).numpy()
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    got = MoE(loaded.cfg).apply({"params": layout.to_canonical(loaded.params, loaded.cfg)["layer_1"]["moe"]}, jnp.asarray(x.numpy()), positions)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def np_llada_attention(sd, layer, x, c):
    """NumPy reference: fused QKV split, per-head RMSNorm, partial rotary (first half of each
    head, half-split pairs), GQA, block-causal softmax, dense output projection."""
    h, k, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    a = f"model.layers.{layer}.attention"
    qkv = x @ sd[f"{a}.query_key_value.weight"].numpy().T.astype(np.float64)
    t = x.shape[0]
    q = qkv[:, : h * dh].reshape(t, h, dh)
    kk = qkv[:, h * dh: (h + k) * dh].reshape(t, k, dh)
    v = qkv[:, (h + k) * dh:].reshape(t, k, dh)

    def rms(z, wt):
        return z / np.sqrt((z ** 2).mean(-1, keepdims=True) + c["rms_norm_eps"]) * wt

    q = rms(q, sd[f"{a}.query_layernorm.weight"].numpy())
    kk = rms(kk, sd[f"{a}.key_layernorm.weight"].numpy())
    rot = int(dh * c["partial_rotary_factor"])
    inv = 1.0 / c["rope_theta"] ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(z):
        z1, z2 = z[..., : rot // 2], z[..., rot // 2: rot]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin, z[..., rot:]], -1)

    q, kk = rope(q), rope(kk)
    out = np.zeros((t, h, dh))
    pos = np.arange(t)
    visible = pos[None, :] < (pos[:, None] // BLOCK + 1) * BLOCK
    for head in range(h):
        g = head // (h // k)
        s = q[:, head] @ kk[:, g].T / np.sqrt(dh)
        s = np.where(visible, s, -np.inf)
        wgt = np.exp(s - s.max(-1, keepdims=True))
        wgt /= wgt.sum(-1, keepdims=True)
        out[:, head] = wgt @ v[:, g]
    return out.reshape(t, h * dh) @ sd[f"{a}.dense.weight"].numpy().T


def test_llada2_attention_matches_numpy(llada):
    sd, loaded = llada
    x = np.random.default_rng(4).normal(size=(11, LLADA["hidden_size"]))
    pos = jnp.arange(11)[None]
    got, _ = Attention(loaded.cfg).apply({"params": layout.to_canonical(loaded.params, loaded.cfg)["layer_0"]["attn"]},
                                         jnp.asarray(x[None], jnp.float32),
                                         ForwardMeta.explicit(pos, block_causal_mask(pos, BLOCK)), None, None)
    want = np_llada_attention(sd, 0, x, LLADA)
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=1e-4, rtol=1e-4)


def test_llada2_stacked_experts_convert_to_the_same_model(tmp_path, llada):
    sd, loaded = llada
    stacked = dict(sd)
    p, e = "model.layers.1.mlp", LLADA["num_experts"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stacked[f"{p}.experts.{proj}"] = torch.stack([stacked.pop(f"{p}.experts.{j}.{proj}.weight")
                                                      for j in range(e)])
    convert(write_llada(tmp_path / "hf", stacked), tmp_path / "out", dtype="float32",
            block_size=BLOCK, progress=False)
    other = load_model(str(tmp_path / "out"))
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(other.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_corruption_and_missing_tensors_are_named(tmp_path):
    sd = llada_state_dict(seed=1)
    src = write_llada(tmp_path / "hf", sd)
    out = tmp_path / "out"
    convert(src, out, dtype="float32", block_size=BLOCK, progress=False)
    load_model(str(out))  # intact: loads
    victim = max((p for p in (out / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    rel = str(victim.relative_to(out))
    with pytest.raises(ConfigError, match=f"file {rel} does not match its checksum"):
        load_model(str(out))
    victim.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(ConfigError, match="does not match its checksum"):
        load_model(str(out))

    dropped = dict(sd)
    del dropped["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(UserError, match="missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"):
        convert(write_llada(tmp_path / "hf2", dropped), tmp_path / "out2", block_size=BLOCK,
                progress=False)
    reshaped = dict(sd)
    reshaped["model.layers.0.attention.dense.weight"] = torch.zeros(32, 16)
    with pytest.raises(UserError, match="tensor 'model.layers.0.attention.dense.weight' has shape"):
        convert(write_llada(tmp_path / "hf3", reshaped), tmp_path / "out3", block_size=BLOCK,
                progress=False)
    with pytest.raises(UserError, match="states no diffusion block size.*pass --block-size"):
        convert(write_llada(tmp_path / "hf4", sd), tmp_path / "out4", progress=False)
