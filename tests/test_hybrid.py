"""The Gated DeltaNet hybrid family: Qwen3-Next and Qwen3.5-MoE checkpoints built with
transformers, converted, and run by the full-sequence forward; the sequence-module config."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import yaml

from mbd_jax import chat
from mbd_jax.checkpoint import load_model
from mbd_jax.config import (ConfigError, DecodeConfig, SequenceModule, config_dict, from_dict,
                            load_model_config)
from mbd_jax.convert import convert
from mbd_jax.engine import Engine
from mbd_jax.errors import UserError
from mbd_jax.model import sizes
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer, block_causal_mask, init_params
from tests.conftest import tiny_cfg, tiny_params
from tests.test_convert import _randomise

MASK_ID, EOS_ID = 3, 1
SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             intermediate_size=64, max_position_embeddings=256, eos_token_id=EOS_ID, pad_token_id=0,
             tie_word_embeddings=False, rms_norm_eps=1e-6)


def hf_hybrid(family: str, seed: int = 0):
    """A tiny random Qwen3-Next (projections grouped per key head) or Qwen3.5-MoE text model
    (separate projections); layers 0-2 linear attention, layer 3 gated attention."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig as Config, Qwen3NextForCausalLM as Model
    else:
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
    model = Model(Config(**SHAPE, attn_implementation="eager"))
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    _randomise(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # as checkpoints keep it: log of a decay rate in (0.01, 16)
                p.copy_(torch.log(torch.linspace(0.5, 4.0, p.numel())))
            if name == "lm_head.weight":  # logits of a few units: float32 rounding (~1e-5
                p.mul_(0.25)  # relative) stays under the 1e-4 the comparison allows
    return model.float().eval()


MODES = {"qwen3_next": "causal", "qwen3_5_moe_text": "bidirectional"}  # each written by convert


@pytest.fixture(scope="module", params=sorted(MODES))
def converted(request, tmp_path_factory):
    """(transformers model, converted model directory) at block size 1, in the family's mode."""
    hf = hf_hybrid(request.param)
    src = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(src)
    dst = tmp_path_factory.mktemp(f"{request.param}-converted")
    convert(src, dst, dtype="float32", mask_token_id=MASK_ID, block_size=1,
            block_mode=MODES[request.param], progress=False)
    return hf, dst


def in_mode(cfg, mode: str, block: int):
    return dataclasses.replace(cfg, block_size=block, sequence_module=dataclasses.replace(
        cfg.sequence_module, block_mode=mode, chunk_size=block * max(1, 8 // block)))


def logits_of(cfg, params, tokens: np.ndarray) -> np.ndarray:
    """The full-sequence forward under the block-causal rule (block size 1: causal)."""
    pos = np.tile(np.arange(tokens.shape[1], dtype=np.int32), (tokens.shape[0], 1))
    meta = ForwardMeta.explicit(pos, block_causal_mask(pos, cfg.block_size))
    return np.asarray(jax.jit(lambda p: Transformer(cfg).apply({"params": p}, tokens, meta)[0])(
        params))


def test_converted_hybrid_logits_equal_transformers_at_block_size_1(converted):
    """Both block modes are the autoregressive model at block size 1; the converted checkpoint's
    logits equal transformers' own forward over 40 tokens (chunk boundaries, the conv tail, the
    (1 + w) norms, the gated attention and the shared-expert gate all exercised). At block size 4
    the modes read a block differently in the linear layers, so their logits differ."""
    hf, d = converted
    m = load_model(str(d))
    assert m.cfg.sequence_module.block_mode == MODES[hf.config.model_type]  # what convert was told
    assert m.cfg.sequence_module.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    tokens = np.random.default_rng(1).integers(4, SHAPE["vocab_size"], (2, 40)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(want).max() > 1.0  # far from uniform: a wrong weight would show
    for block_mode in ("causal", "bidirectional"):
        got = logits_of(in_mode(m.cfg, block_mode, 1), m.params, tokens)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=block_mode)
    causal, bidirectional = (logits_of(in_mode(m.cfg, b, 4), m.params, tokens[:1, :16])
                             for b in ("causal", "bidirectional"))
    assert np.abs(causal - bidirectional).max() > 1e-3


def test_sequence_module_fields_are_checked_at_load(converted, tmp_path):
    """A missing or wrong sequence-module field is refused by name; the written config reads
    back equal."""
    _, model_dir = converted
    cfg = load_model(str(model_dir)).cfg
    d = config_dict(cfg)
    assert from_dict(type(cfg), d, "roundtrip") == cfg
    for edit, needle in [
        (lambda s: s.pop("block_mode"), "missing required field 'block_mode'"),
        (lambda s: s.__setitem__("block_mode", "sideways"), "field 'block_mode' must be one of"),
        (lambda s: s.__setitem__("layer_types", ["linear_attention"] * 3), "lists 3 layers"),
        (lambda s: s.__setitem__("num_value_heads", 3), "multiple of 'num_key_heads'"),
        (lambda s: s.__setitem__("chunk", 64), "unknown field"),
    ]:
        bad = config_dict(cfg)
        edit(bad["sequence_module"])
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=needle):
            load_model_config(path)
    with pytest.raises(ConfigError, match="sequence_module: missing required field 'type'"):
        from_dict(SequenceModule, {k: v for k, v in d["sequence_module"].items() if k != "type"},
                  "sequence_module")


def test_conversion_needs_a_block_mode_for_a_hybrid(tmp_path):
    hf = hf_hybrid("qwen3_next")
    hf.save_pretrained(tmp_path / "src")
    with pytest.raises(UserError, match="no block_mode.*--block-mode"):
        convert(tmp_path / "src", tmp_path / "dst", dtype="float32", mask_token_id=MASK_ID,
                block_size=1, progress=False)


def test_param_count_matches_transformers(converted):
    hf, d = converted
    cfg = load_model(str(d)).cfg
    assert sizes.num_params(cfg) == sum(p.numel() for p in hf.parameters())


# ---------------------------------------------------------------- the state cache
def hybrid_cfg(mode: str, loop: str = "unrolled"):
    """tiny-random (three layers, seed 0) as a hybrid: layer 0 (dense MLP) and 2 (MoE) linear
    attention, layer 1 gated attention; block 8, chunk 16."""
    sm = SequenceModule(type="gated_deltanet", block_mode=mode,
                        layer_types=("linear_attention", "full_attention", "linear_attention"),
                        num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8,
                        conv_kernel=4, chunk_size=16)
    kw = dict(num_layers=3, seed=0, sequence_module=sm, attention_output_gate=True,
              norm_weight_offset=True, shared_expert_gate=True, layer_loop=loop)
    return tiny_cfg(**kw), tiny_params(**kw)


@pytest.mark.parametrize("mode,loop", [("causal", "unrolled"), ("bidirectional", "unrolled"),
                                       ("bidirectional", "scan")])
def test_state_cache_equals_full_forward_and_noisy_blocks_never_enter_it(mode, loop):
    """Prefill (mixed prompt lengths, chunks of 16 over 8-token blocks) then MultiBD windows of
    two blocks, each forward committing only the first: the window's logits equal the
    full-sequence forward's at every position, although its second block holds noise when it is
    read (the next window reads it clean: the committed state never absorbed the noise)."""
    cfg, params = hybrid_cfg(mode, loop)
    blk = cfg.block_size
    apply = jax.jit(Transformer(cfg).apply)
    prompt_lens = [3, 8, 21, 40]
    b, n_windows = len(prompt_lens), 3
    total = max(prompt_lens) // blk * blk + (n_windows + 1) * blk
    rng = np.random.default_rng(0)
    seqs = rng.integers(5, cfg.vocab_size, (b, total)).astype(np.int32)
    pos = np.broadcast_to(np.arange(total, dtype=np.int32), (b, total))
    full, _ = apply({"params": params}, seqs, ForwardMeta.explicit(pos, block_causal_mask(pos, blk)))

    engine = Engine(cfg, params, batch_size=b, prefill_chunk=16, row_prefill_min=8)
    engine.admit(engine.empty_state(), {i: (seqs[i, :n], DecodeConfig())
                                        for i, n in enumerate(prompt_lens)})
    kv = engine.kv
    offset = np.array([n // blk * blk for n in prompt_lens], np.int32)
    worst = 0.0
    for _ in range(n_windows):
        clean = np.stack([seqs[i, o:o + 2 * blk] for i, o in enumerate(offset)])
        noisy = clean.copy()
        noisy[:, blk:] = rng.integers(5, cfg.vocab_size, (b, blk))  # the second block: noise
        positions = offset[:, None] + np.arange(2 * blk, dtype=np.int32)
        meta = ForwardMeta.cached(positions, offset, offset + 2 * blk,
                                  commit=np.full(b, blk, np.int32))
        _, kv_noisy = apply({"params": params}, noisy, meta, kv)  # commits block 1 only
        logits, _ = apply({"params": params}, clean, meta, kv)
        for i, o in enumerate(offset):
            worst = max(worst, float(np.abs(np.asarray(logits[i]) - full[i, o:o + 2 * blk]).max()))
        kv, offset = kv_noisy, offset + blk
    assert worst <= 1e-5, f"max abs logit diff {worst}"


def test_hybrid_engine_generates_batch_invariantly_with_reused_rows():
    """Greedy SingleBD and MultiBD on the hybrid: five prompts on two rows (rows reused: a reused
    row starts from a zero state) give the tokens each prompt gives alone (the one running row
    decoding over its own cache row and recurrent state: Engine.decode_call's one-row program),
    and a warmed-up engine compiles nothing for a second batch; MultiBD with eager activation
    (both blocks from the first forward) too."""
    from mbd_jax import compile_stats

    cfg, params = hybrid_cfg("bidirectional")
    prompts = [[7, 8, 9], list(range(20, 41)), [5] * 12, list(range(100, 109)), [9, 3]]
    for n_buf in (1, 2):
        engine = Engine(cfg, params, batch_size=2, buffer_size=n_buf, prefill_chunk=16)
        for activation in ("progress", "eager")[:n_buf]:
            decode = DecodeConfig(buffer_size=n_buf, max_new_tokens=16, block_activation=activation)
            together = [r.token_ids for r in engine.generate(prompts, decode)]
            c0 = compile_stats.compiles()
            again = [r.token_ids for r in engine.generate(prompts[::-1], decode)][::-1]
            assert compile_stats.compiles() == c0 and again == together, decode
            alone = [engine.generate([p], decode)[0].token_ids for p in (prompts[2], prompts[4])]
            assert [together[2], together[4]] == alone and compile_stats.compiles() == c0, decode
            assert any(len(t) > 4 for t in together)


# the causal mode stores the same boundary states (the in-block rule differs, which the state-cache
# test above covers for both modes)
@pytest.mark.parametrize("mode,loop", [pytest.param("causal", "unrolled", marks=pytest.mark.slow),
                                       ("bidirectional", "scan")])
def test_the_prefix_store_serves_a_hybrid_exactly(tmp_path, mode, loop):
    """The prefix store keeps a hybrid's recurrent state where rows' committed blocks ended:
    after each prefill round (here every 16 tokens, and a prompt's last full block) and a
    reply's committed blocks. A prompt sent again, one sharing a part of it, and a second turn
    that repeats the first turn and its reply load their blocks and the state from it (RAM, then
    disk after a restart) and decode what a cold engine decodes, with the first forward's logits
    within 1e-5; a hit stops at the last shared block that has a state; a warm engine compiles
    nothing for it."""
    from mbd_jax import compile_stats
    from mbd_jax.cache.prefix_store import PrefixStore, state_key
    from tests.test_prefix_cache import first_step_logits

    cfg, params = hybrid_cfg(mode, loop)
    rng = np.random.default_rng(5)
    shared = rng.integers(10, 500, size=45).tolist()  # 5 full blocks of 8
    other = shared[:33] + rng.integers(10, 500, size=12).tolist()  # shares 4 blocks with it
    third = shared[:28] + rng.integers(10, 500, size=17).tolist()  # 3 blocks, states at 2
    d = DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True)

    def engine(store=None):
        e = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=16, prefix_store=store)
        e.warmup()
        return e

    def store():
        return PrefixStore("hybrid", cfg.block_size, ram_bytes=1 << 24, storage_path=tmp_path,
                           disk_bytes=1 << 26)

    cold = engine()
    first = cold.generate([shared, other], d)
    turn2 = shared + first[0].token_ids + rng.integers(10, 500, size=7).tolist()
    cold_turn2 = cold.generate([turn2], d)[0].token_ids
    cold_third = cold.generate([third], d)[0].token_ids
    cold_logits = [first_step_logits(cold, p) for p in (shared, turn2)]

    s1 = store()
    warm = engine(s1)
    assert [r.token_ids for r in warm.generate([shared, other], d)] == [r.token_ids for r in first]
    warm.offloader.flush()
    assert s1.stats.hits == 0 and warm.offloader.stats.staged_states >= 2
    keys = s1.keys(shared)
    assert all(state_key(keys[b]) in s1 for b in (1, 3, 4))  # prefill rounds end at 16, 32, 40
    assert state_key(keys[2]) not in s1 and state_key(keys[0]) not in s1
    hits, compiled = warm.prefix_hit_tokens, compile_stats.compiles()
    assert [r.token_ids for r in warm.generate([shared, other], d)] == [r.token_ids for r in first]
    assert warm.prefix_hit_tokens - hits == 80 and s1.stats.hits == 10  # 5 blocks each
    assert compile_stats.compiles() == compiled  # loads and snapshots were compiled in warmup
    hits = warm.prefix_hit_tokens
    assert warm.generate([third], d)[0].token_ids == cold_third
    assert warm.prefix_hit_tokens - hits == 16  # 3 shared blocks, the last state after block 1
    assert warm.generate([turn2], d)[0].token_ids == cold_turn2
    assert warm.prefix_hit_tokens - hits > 40  # into the first turn's reply
    np.testing.assert_allclose(first_step_logits(warm, shared), cold_logits[0], atol=1e-5)
    warm.offloader.close()

    s2 = store()  # a restart on the same storage path: blocks and states from disk
    again = engine(s2)
    assert again.generate([turn2], d)[0].token_ids == cold_turn2
    assert s2.stats.hits > 5 and s2.stats.corrupt == 0
    np.testing.assert_allclose(first_step_logits(again, turn2), cold_logits[1], atol=1e-5)
    again.offloader.close()


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_each_layer_kind_holds_only_its_own_cache(loop):
    """KV pages for the attention layer only, a state and conv tail for the two linear layers
    only (no memory for the other kind's entries), in both pool forms; a model without an
    attention layer has no pool at all and still decodes."""
    cfg, params = hybrid_cfg("causal", loop)
    kv = Engine(cfg, params, batch_size=2, prefill_chunk=16).kv
    count = (lambda a: a.shape[0]) if loop == "scan" else len
    pool, states = kv.entries["full_attention"], kv.entries["linear_attention"]
    assert (count(pool.k), count(pool.v), count(states.state), count(states.tail)) == (1, 1, 2, 2)
    assert kv.slots == (0, 0, 1) and sorted(kv.entries) == ["full_attention", "linear_attention"]
    linear = dataclasses.replace(cfg, sequence_module=dataclasses.replace(
        cfg.sequence_module, layer_types=("linear_attention",) * 3))
    engine = Engine(linear, init_params(linear), batch_size=1, prefill_chunk=16)
    assert list(engine.kv.entries) == ["linear_attention"] and engine.kv.positional is None
    assert count(engine.kv.entries["linear_attention"].state) == 3
    out = engine.generate([[7, 8, 9, 10]], DecodeConfig(max_new_tokens=8))[0].token_ids
    assert len(out) == 8



def test_the_service_serves_a_hybrid_like_offline_generate(tmp_path):
    """`mbd-jax serve` on tiny-hybrid with the prefix cache on: completions, streamed or not,
    equal offline generation with MultiBD (the second and third sends of a prompt load its
    blocks and recurrent state from the store); voting answers; thinking has its template."""
    import httpx

    from mbd_jax.checkpoint import load_model as load
    from tests.live_server import KEY, Server

    # two rows and 16-token prefill chunks: fewer programs to compile than the default 8 and 64
    srv = Server(tmp_path, [KEY], sections={"model": "tiny-hybrid", "cache": {"enabled": True}},
                 max_batch_size=2, prefill_chunk=16)
    try:
        m = load("tiny-hybrid")
        engine = Engine(m.cfg, m.params, batch_size=2, buffer_size=2, prefill_chunk=16,
                        tokenizer=m.tokenizer)
        prompts = ["Sort: 3 1 2 and then say what the sum of all of them is", "What is 12 + 30?"]
        want = engine.generate([m.tokenizer.encode(p) for p in prompts],
                               DecodeConfig(buffer_size=2, max_new_tokens=20))
        with httpx.Client(base_url=srv.url, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as http:
            for p, w in zip(prompts, want):
                body = {"model": "tiny-hybrid", "prompt": p, "max_tokens": 20}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == w.text, r.text
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                    events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
                chunks = [json.loads(e) for e in events if e != "[DONE]"]
                assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == w.text
            assert any(len(w.token_ids) > 4 for w in want)
            assert srv.metrics()["mbd_prefix_cache_hit_blocks_total"] > 0
            r = http.post("/v1/completions", json={  # voting reads the recorded trajectories
                "prompt": prompts[1], "max_tokens": 16,
                "decoding": {"voting": {"extractor": "regex", "pattern": r"(\w+)"}}})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["voting"]["final_answer"] is not None
            messages = [{"role": "user", "content": prompts[0]}]  # thinking: its own template
            r = http.post("/v1/chat/completions",
                          json={"messages": messages, "thinking": True, "max_tokens": 16})
            assert r.status_code == 200, r.text
            (think,) = engine.generate([m.tokenizer.encode(chat.render(messages, thinking=True))],
                                       DecodeConfig(buffer_size=2, max_new_tokens=16))
            message = r.json()["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == \
                chat.split_reasoning(think.text)
    finally:
        srv.stop()
