"""DiffusionGemma against transformers' own implementation: a tiny random checkpoint written by
`save_pretrained` (safetensors), converted; the encoder pass's KV equals transformers' cache and
the decoder pass's logits equal its logits (given the same cache, canvas and self-conditioning
logits) within 1e-4, on sliding and global layers, with a context longer than the window and
after a canvas is committed. Under the deterministic contract, generation equals transformers'
own `generate` (its sampler classes given the contract's noise, its multinomial draw replaced by
the argmax) token for token and forward for forward."""

from __future__ import annotations

import dataclasses
import json
import math
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from mbd_jax.config.diffusion_gemma import CanvasDecoding
from mbd_jax.convert_diffusion_gemma import config_from_hf, decoding_from_hf, params_from_hf
from mbd_jax.errors import ConfigError, UserError
from mbd_jax.decoding import canvas_loop
from mbd_jax.model import diffusion_gemma as dg

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
            num_global_key_value_heads=1, sliding_window=8, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, max_position_embeddings=256, pad_token_id=0,
            eos_token_id=1, bos_token_id=2)
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8)
CANVAS = 8


def _convert(model, path):
    """(our config, our params) of `model` saved to `path` by save_pretrained."""
    from safetensors import safe_open

    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    ours = config_from_hf(json.loads((path / "config.json").read_text()), "tiny-dgemma")
    return ours, params_from_hf(tensors.__getitem__, set(tensors), ours)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the transformers model, our config and params converted from its saved checkpoint)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=CANVAS)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and scales away from their init of one, the modes' scalars apart
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "layernorm_1.weight",
                              "layernorm_2.weight", "router.scale", "per_expert_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        model.model.decoder.embed_tokens.weight.mul_(8.0)  # logits of a few units (tied head)
        for i in range(TEXT["num_hidden_layers"]):
            model.model.decoder.layers[i].layer_scalar.fill_(0.5 + 0.1 * i)
            model.model.encoder.language_model.layers[i].layer_scalar.fill_(1.3 - 0.2 * i)
    path = tmp_path_factory.mktemp("dgemma")
    return (model, *_convert(model, path), path)


def test_the_config_converts(reference):
    _, cfg, params, _ = reference
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (cfg.head(0), cfg.head(2)) == ((2, 8), (1, 16))
    assert (cfg.global_rope_fraction, cfg.canvas_length, cfg.eos_token_ids) == (0.25, 8, (1,))
    assert "v" in params["layers"][0]["attn"] and "v" not in params["layers"][2]["attn"]
    assert params["layers"][1]["scalar"].tolist() == pytest.approx([0.6, 1.1])  # decoder, encoder


def _hf_encode(model, ids, cache=None):
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config.text_config)
    start = cache.get_seq_length()
    with torch.no_grad():
        model.model.encoder(input_ids=torch.tensor(ids), cache=cache,
                            position_ids=torch.arange(start, start + len(ids[0]))[None])
    return cache


def test_encoder_kv_and_decoder_logits_equal_transformers(reference):
    """Prompt of 20 tokens (the window is 8), a first canvas decoded with and without
    self-conditioning, committed, and a second canvas decoded after it."""
    model, cfg, params, _ = reference
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, TEXT["vocab_size"], (1, 20))
    hf_cache = _hf_encode(model, prompt.tolist())
    cache = dg.encode(params, cfg, jnp.asarray(prompt, jnp.int32), jnp.zeros(1, jnp.int32),
                      dg.allocate_cache(cfg, 1, 64))
    _check_cache(cfg, cache, hf_cache, 20)

    worst = 0.0
    cached = 20
    for canvas_no in range(2):
        canvas = rng.integers(0, TEXT["vocab_size"], (1, CANVAS))
        sc = rng.normal(size=(1, CANVAS, TEXT["vocab_size"])).astype(np.float32) * 3
        for with_sc in (False, True):
            with torch.no_grad():
                want = model(decoder_input_ids=torch.tensor(canvas), cache=hf_cache,
                             self_conditioning_logits=torch.tensor(sc) if with_sc else None,
                             decoder_position_ids=torch.arange(cached, cached + CANVAS)[None]
                             ).logits.numpy()
            got = np.asarray(dg.decode(params, cfg, jnp.asarray(canvas, jnp.int32),
                                       jnp.asarray([cached], jnp.int32), cache,
                                       dg.soft_embedding(params, cfg, jnp.asarray(sc)),
                                       jnp.asarray([with_sc])))
            assert np.abs(want).max() > 1.0
            worst = max(worst, float(np.abs(got - want).max()))
        # commit the canvas: the encoder pass over it at its positions
        hf_cache = _hf_encode(model, canvas.tolist(), hf_cache)
        cache = dg.encode(params, cfg, jnp.asarray(canvas, jnp.int32),
                          jnp.asarray([cached], jnp.int32), cache)
        cached += CANVAS
        _check_cache(cfg, cache, hf_cache, cached)
    assert worst < 1e-4, worst


def _check_cache(cfg, cache, hf_cache, length):
    """Our KV at the positions transformers keeps (a sliding layer: its last window - 1)."""
    for i, layer in enumerate(hf_cache.layers):
        kept = layer.keys.shape[2]
        assert kept == (min(length, cfg.sliding_window - 1)
                        if cfg.layer_types[i] == "sliding_attention" else length)
        for ours, theirs in ((cache.layers[i]["k"], layer.keys), (cache.layers[i]["v"], layer.values)):
            got = np.asarray(ours[0, length - kept:length])  # [kept, K, Dh]
            np.testing.assert_allclose(got, theirs[0].transpose(0, 1).numpy(), atol=1e-5)


def test_generation_settings_and_bad_values_are_named(reference):
    _, _, _, path = reference
    d = decoding_from_hf({"max_denoising_steps": 48, "sampler_config": {"entropy_bound": 0.1},
                          "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
                          "confidence_threshold": 0.005})
    assert (d.steps, d.entropy_bound, d.t_min, d.t_max, d.stability) == (48, 0.1, 0.4, 0.8, 1)
    for bad, field in (({"t_min": 0.9}, "t_max"), ({"sampler_config": {"entropy_bound": 0.0}},
                                                   "entropy_bound"),
                       ({"max_denoising_steps": 0}, "steps")):
        with pytest.raises(ConfigError, match=field):
            decoding_from_hf(bad)
    hf = json.loads((path / "config.json").read_text())
    hf["text_config"]["hidden_activation"] = "silu"
    with pytest.raises(UserError, match="hidden_activation"):
        config_from_hf(hf, "x")


# ---------------------------------------------------------------- generation, the contract
def transformers_generate(model, prompt: list[int], d: CanvasDecoding) -> tuple[list[int], int]:
    """transformers' DiffusionGemma `generate` under the deterministic contract: its entropy-
    bound sampler with the contract's canvases and re-draws, torch.multinomial as the argmax.
    Returns (the generated ids, decoder forwards)."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

    class ContractSampler(gen.EntropyBoundSampler):
        canvas_index, k = -1, 0

        def draw(self, batch, device):
            i = torch.arange(self.canvas_length, device=device)
            ids = (7 * i + 13 * self.k + 31 * self.canvas_index + 3) % self.vocab_size
            return ids[None].expand(batch, -1).clone()

        def initialize_canvas(self, batch_size, device):
            self.canvas_index, self.k = self.canvas_index + 1, 0
            return self.draw(batch_size, device)

        def renoise_canvas(self, accepted_canvas, cur_step):
            self.k += 1
            fresh = self.draw(accepted_canvas.shape[0], accepted_canvas.device)
            return torch.where(self.accepted_token_mask, accepted_canvas, fresh)

    forwards = [0]
    plain = type(model).forward

    def counted(self, *args, **kwargs):
        forwards[0] += 1
        return plain(self, *args, **kwargs)

    model._prepare_sampler = lambda gc: ContractSampler(
        gc.sampler_config, model.config.canvas_length, TEXT["vocab_size"], gc.max_denoising_steps)
    with mock.patch.object(type(model), "forward", counted), \
            mock.patch("torch.multinomial", lambda probs, num_samples: probs.argmax(-1, keepdim=True)):
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=d.max_new_tokens, max_denoising_steps=d.steps,
            sampler_config=gen.EntropyBoundSamplerConfig(d.entropy_bound), t_min=d.t_min,
            t_max=d.t_max, stability_threshold=d.stability, confidence_threshold=d.confidence,
            eos_token_id=TEXT["eos_token_id"], pad_token_id=TEXT["pad_token_id"])
    del model._prepare_sampler
    return out.sequences[0, len(prompt):].tolist(), forwards[0]


PROMPTS = [np.random.default_rng(0).integers(3, TEXT["vocab_size"], n).tolist() for n in (5, 13, 20)]
CONTRACT = CanvasDecoding(steps=6, entropy_bound=0.5, noise="deterministic", max_new_tokens=24)
# cool and permissive enough that the tiny random model's canvases can settle before 24 steps
SETTLING = dataclasses.replace(CONTRACT, steps=24, entropy_bound=50.0, confidence=10.0, t_min=0.1,
                               t_max=0.2)


@pytest.fixture(scope="module")
def eos_model(reference, tmp_path_factory):
    """The reference with EOS made likely (its tied embedding row scaled): rows end early."""
    import copy

    model = copy.deepcopy(reference[0])
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[TEXT["eos_token_id"]].mul_(3.0)
    return (model, *_convert(model, tmp_path_factory.mktemp("dgemma-eos")))


@pytest.mark.parametrize("case", ["three-canvases", "eos", "adaptive-stop", "mixed-settings"])
def test_generation_equals_transformers_under_the_contract(reference, eos_model, case):
    """Batched rows (prompts of 5, 13 and 20 tokens, each row its own settings) against
    transformers one prompt at a time: the same tokens (pads after an EOS included) and the
    same decoder forwards; adaptive stopping both hit and not hit."""
    model, cfg, params = (eos_model if case == "eos" else reference)[:3]
    decodings = {
        "three-canvases": [CONTRACT] * 3,
        "eos": [dataclasses.replace(CONTRACT, max_new_tokens=40)] * 3,
        "adaptive-stop": [SETTLING] * 3,
        "mixed-settings": [dataclasses.replace(SETTLING, max_new_tokens=8),
                           CONTRACT,
                           dataclasses.replace(CONTRACT, t_min=0.2, t_max=1.5, stability=2)],
    }[case]
    got = canvas_loop.generate(params, cfg, PROMPTS, decodings)
    for prompt, d, r in zip(PROMPTS, decodings, got):
        want, forwards = transformers_generate(model, prompt, d)
        assert r.token_ids == want and r.decoder_passes == forwards, (case, prompt)
    steps = sum(math.ceil(d.max_new_tokens / CANVAS) * d.steps for d in decodings)
    if case == "eos":
        assert all(r.finish_reason == "stop" and TEXT["pad_token_id"] in r.token_ids for r in got)
    if case == "adaptive-stop":
        assert sum(r.decoder_passes for r in got) < steps  # some canvas settled early
    if case == "three-canvases":
        assert any(r.canvases == 3 and r.finish_reason == "length" for r in got)


def test_seeded_sampling_and_no_compiles_after_the_first_call(reference):
    from mbd_jax import compile_stats

    _, cfg, params, _ = reference
    sampled = dataclasses.replace(CONTRACT, noise="uniform", seed=7)
    first = canvas_loop.generate(params, cfg, PROMPTS, [sampled] * 3)
    before = compile_stats.compiles()
    again = canvas_loop.generate(params, cfg, PROMPTS, [sampled] * 3)
    other = canvas_loop.generate(params, cfg, PROMPTS, [dataclasses.replace(sampled, seed=8)] * 3)
    assert compile_stats.compiles() == before
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


def test_the_cli_converts_a_checkpoint_and_generates_like_transformers(reference, tmp_path):
    """`mbd-jax convert` on the save_pretrained directory writes a model directory (manifest,
    generation.yaml); `mbd-jax generate --noise deterministic` on it answers what transformers
    does (its output: to the first EOS); serve without a tokenizer is refused by name."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.live_server import free_port

    model, _, _, path = reference
    out = tmp_path / "dgemma"
    run = lambda *a: subprocess.run([sys.executable, "-m", "mbd_jax", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT, timeout=600)
    r = run("convert", "--src", str(path), "--dst", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["family"] == "diffusion_gemma"
    assert (out / "manifest.json").is_file() and (out / "generation.yaml").is_file()
    prompt = PROMPTS[1]
    r = run("generate", "--model", str(out), "--prompt-ids", ",".join(map(str, prompt)),
            "--noise", "deterministic", "--denoising-steps", "6", "--entropy-bound", "0.5",
            "--max-new-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want, forwards = transformers_generate(model, prompt, CONTRACT)
    eos = next((j for j, t in enumerate(want) if t == TEXT["eos_token_id"]), len(want))
    assert (got["token_ids"], got["decoder_passes"]) == (want[:eos], forwards)
    r = run("serve", "--model", str(out), "--port", str(free_port()), "--admin-port",
            str(free_port()))
    assert r.returncode != 0 and "needs a tokenizer" in r.stderr and "Traceback" not in r.stderr
    r = run("verify", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout
    (out / "tokenizer.json").unlink(missing_ok=True)  # (no tokenizer here: break a checksum)
    (out / "config.yaml").write_text((out / "config.yaml").read_text() + "\n")
    r = run("verify", str(out), "--json")
    checks = {c["check"]: c["problem"] for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 1 and "config.yaml does not match" in checks["checksums"], checks


@pytest.mark.parametrize("case", ["three-canvases", "adaptive-stop"])
def test_committing_with_the_next_canvas_first_step_is_exact(reference, case):
    """buffer_size 2: each canvas's commit shares one forward with the next canvas's first
    denoising step. The same tokens and decoder passes as the sequential schedule under the
    contract, one forward fewer per committed canvas."""
    _, cfg, params, _ = reference
    d = CONTRACT if case == "three-canvases" else SETTLING
    one = canvas_loop.generate(params, cfg, PROMPTS, [d] * 3)
    two = canvas_loop.generate(params, cfg, PROMPTS, [dataclasses.replace(d, buffer_size=2)] * 3)
    for a, b in zip(one, two):
        assert (b.token_ids, b.decoder_passes) == (a.token_ids, a.decoder_passes)
        assert a.forwards == 1 + a.decoder_passes + (a.canvases - 1)  # prefill, commits
        assert b.forwards == a.forwards - (a.canvases - 1)
    assert sum(a.canvases for a in one) > 3  # some commits were there to fold


def test_the_sampler_runs_in_row_chunks_with_the_same_tokens_and_less_memory():
    """The LM head and the sampler run `sampler_rows` rows at a time: the same tokens (seeded
    sampling, per-row keys) whatever the chunk, and the compiled step's temporaries grow with
    the rows a chunk holds ([C, V] arrays per row), not with the batch."""
    import jax

    from mbd_jax import canvas_model

    m = canvas_model.load("tiny-dgemma")
    cfg, params, b = m.cfg, m.params, 8
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, 5 + i).tolist() for i in range(b)]
    d = CanvasDecoding(steps=4, seed=3, max_new_tokens=32)
    one = canvas_loop.generate(params, cfg, prompts, [d] * b, sampler_rows=1)
    all_rows = canvas_loop.generate(params, cfg, prompts, [d] * b, sampler_rows=b)
    assert [r.token_ids for r in one] == [r.token_ids for r in all_rows]

    p = canvas_loop.CanvasParams.of([d] * b)
    st = canvas_loop.start_canvas(cfg, p, jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), 1)
    cache = dg.allocate_cache(cfg, b, 64)

    def temporaries(rows: int) -> int:
        step = jax.jit(lambda st, cache: canvas_loop.denoise(
            params, cfg, p, st, cache, jnp.full(b, 24, jnp.int32), None, rows))
        return step.lower(st, cache).compile().memory_analysis().temp_size_in_bytes

    row_logits = cfg.canvas_length * cfg.vocab_size * 4
    assert temporaries(1) + (b - 1) * row_logits <= temporaries(b)


def test_out_of_range_settings_stop_before_the_device(reference):
    _, cfg, params, _ = reference
    for bad, field in ((dict(t_max=0.1), "t_max"), (dict(entropy_bound=0.0), "entropy_bound"),
                       (dict(buffer_size=3), "buffer_size")):
        with pytest.raises(ConfigError, match=f"decoding\\[0\\].*{field}"):
            canvas_loop.generate(params, cfg, PROMPTS[:1], [dataclasses.replace(CONTRACT, **bad)])
