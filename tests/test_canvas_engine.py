"""The canvas engine (DiffusionGemma in the paged pool, continuously batched) against
transformers' own `generate` under the deterministic contract: rows admitted while others are
mid-canvas, mixed settings, EOS endings, adaptive stops and both commit schedules give the same
tokens and decoder forwards as transformers run one prompt at a time; prompts sharing a prefix
share its pool pages; nothing compiles after the warm-up. And `mbd-jax serve` serves the family
through the OpenAI API (a real openai client: chat, streaming one canvas at a time, stop
strings, n with seeds), refusing what it does not take by field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mbd_jax import compile_stats
from mbd_jax.engine.canvas_engine import CanvasEngine
from mbd_jax.engine.canvas_rows import canvas_output
from mbd_jax.engine.rows import EngineRequest
from mbd_jax.errors import UserError
from tests import test_diffusion_gemma as dgt
from tests.test_diffusion_gemma import (CANVAS, CONTRACT, PROMPTS, SETTLING, TEXT,
                                        transformers_generate)

reference, eos_model = dgt.reference, dgt.eos_model  # the fixtures: transformers' model, converted


def _output(ids: list[int], max_new: int) -> list[int]:
    """transformers' whole canvases (pads after an EOS) as the engine outputs them: to the
    first EOS, at most max_new tokens."""
    out = []
    for k in range(0, len(ids), CANVAS):
        new, _, ends = canvas_output(ids[k: k + CANVAS], max_new - len(out),
                                     (TEXT["eos_token_id"],))
        out += new
        if ends:
            break
    return out


def _engine(cfg, params, **kw) -> CanvasEngine:
    e = CanvasEngine(cfg, params, **{"batch_size": 2, "page_size": CANVAS, "max_len": 96,
                                     "prefill_chunk": 8, **kw})
    e.warmup()
    return e


@pytest.mark.parametrize("case", ["mixed", "eos", "one-row"])
def test_the_engine_decodes_like_transformers(reference, eos_model, case):
    """Five requests on two rows (the later ones admitted as rows free up, beside a row that is
    mid-generation; "one-row": one at a time on a single row), each its own settings and commit
    schedule: transformers' tokens and decoder forwards for each, one prompt at a time."""
    model, cfg, params = (eos_model if case == "eos" else reference)[:3]
    prompts = [*PROMPTS, PROMPTS[1][:4], PROMPTS[2] + PROMPTS[0]]
    decodings = [
        dataclasses.replace(CONTRACT, max_new_tokens=20),  # 3 canvases, the last cut
        dataclasses.replace(SETTLING, buffer_size=2),  # adaptive stops, fused commits
        dataclasses.replace(CONTRACT, t_min=0.2, t_max=1.5, stability=2, buffer_size=2),
        dataclasses.replace(SETTLING, max_new_tokens=8),  # one canvas
        dataclasses.replace(CONTRACT, steps=3, max_new_tokens=40),
    ]
    engine = _engine(cfg, params, batch_size=1 if case == "one-row" else 2)
    before = compile_stats.compiles()
    got = engine.generate(prompts, decodings)
    assert compile_stats.compiles() == before  # nothing compiles after the warm-up
    passes = 0
    for prompt, d, r in zip(prompts, decodings, got):
        ids, forwards = transformers_generate(model, prompt, d)
        want = _output(ids, d.max_new_tokens)
        assert (r.token_ids, r.nfe) == (want, forwards), (case, len(prompt))
        assert r.eos == (TEXT["eos_token_id"] in ids[: len(want) + 1])
        assert r.finish_reason == ("stop" if r.eos else "length")
        passes += forwards
    if case == "eos":
        assert sum(r.eos for r in got) >= 3
    else:
        assert passes < sum(-(-d.max_new_tokens // CANVAS) * d.steps for d in decodings)
        assert got[1].bubble_forwards == 0 and got[0].bubble_forwards == got[0].blocks - 1
    engine.pages.check([])  # every page back (prefix pages stay cached)


def test_prompts_sharing_a_prefix_share_its_pages(reference):
    """A second prompt starting with the first one's three full pages maps them (no prefill
    of them) and decodes exactly what it decodes alone."""
    _, cfg, params = reference[:3]
    base = PROMPTS[2][:17]  # pages of 8: two full
    second = base + PROMPTS[0]
    alone = _engine(cfg, params).generate([second], [CONTRACT])[0]
    engine = _engine(cfg, params)
    first, shared = engine.generate([base, second], [CONTRACT, CONTRACT])
    assert engine.stats().pool_hit_tokens == 16
    assert shared.token_ids == alone.token_ids
    later = engine.generate([second], [CONTRACT])[0]  # cached pages, no row holding them
    assert later.token_ids == alone.token_ids and engine.stats().pool_hit_tokens == 32


def test_a_stopped_row_keeps_what_it_was_given_and_a_cancelled_one_frees_its_row(reference):
    _, cfg, params = reference[:3]
    engine = _engine(cfg, params)
    d = dataclasses.replace(CONTRACT, max_new_tokens=40)
    a, b = EngineRequest(PROMPTS[0], d), EngineRequest(PROMPTS[1], d)
    out = engine.step([a, b])
    assert out.admitted == [a, b]
    given = [t for e in out.events if e.request is a for t in e.tokens]
    engine.end(a, "stop")
    engine.end(b)
    out = engine.step()
    [event] = out.events
    assert event.request is a and event.finished
    r = event.result(0.0)
    assert r.token_ids == given and r.finish_reason == "stop"
    assert len(engine.rows) == 0 and engine.pages.in_use == 0


def test_a_long_prompt_prefills_a_chunk_per_step_beside_decoding_rows(reference):
    """A 33-token prompt admitted beside a decoding row takes one 8-token chunk per step (the
    other row's decode calls go on meanwhile) and then decodes what it decodes alone."""
    _, cfg, params = reference[:3]
    long_prompt = PROMPTS[2] + PROMPTS[1]  # 33 tokens: 5 chunks
    d = dataclasses.replace(CONTRACT, max_new_tokens=40)
    alone = _engine(cfg, params).generate([long_prompt], [d])[0]
    engine = _engine(cfg, params)
    first, second = EngineRequest(PROMPTS[0], d), EngineRequest(long_prompt, d)
    engine.step([first])
    out = engine.step([second])
    assert out.admitted == [second] and out.decoded
    row = engine.rows[engine.rows.find(second)]
    assert row.prefilling and row.prefilled == 8
    tokens = []
    while len(engine.rows):
        for e in engine.step().events:
            tokens += e.tokens if e.request is second else []
    assert tokens == alone.token_ids


def test_requests_the_engine_cannot_hold_are_refused_by_field(reference):
    _, cfg, params = reference[:3]
    engine = CanvasEngine(cfg, params, batch_size=1, page_size=CANVAS, max_len=32)
    with pytest.raises(UserError, match="decoding: the prompt .* 32 per row"):
        engine.check_fits(PROMPTS[2], dataclasses.replace(CONTRACT, max_new_tokens=16))
    with pytest.raises(UserError, match="field 'entropy_bound'"):
        engine.check_decode(dataclasses.replace(CONTRACT, entropy_bound=0.0))
    with pytest.raises(UserError, match=r"token id 999 .*\[0, 128\)"):
        engine.check_prompt([3, 999])
    engine.check_fits(PROMPTS[0], dataclasses.replace(CONTRACT, max_new_tokens=16))
    assert np.all(np.asarray(engine.table()) == engine.pages.num_pages)


def test_the_service_serves_a_canvas_model(tmp_path):
    """`mbd-jax serve --model tiny-dgemma`: completions equal the offline engine's tokens;
    a stream sends one chunk per canvas; a stop string cuts the text; n seeded choices are
    seed, seed + 1 (the same again on a repeat); settings and fields the family does not take
    are 400s naming them."""
    import httpx

    from mbd_jax import canvas_model
    from tests.live_server import KEY, Server

    m = canvas_model.load("tiny-dgemma")
    c = m.cfg.canvas_length
    offline = CanvasEngine(m.cfg, m.params, batch_size=2, prefill_chunk=16, tokenizer=m.tokenizer)
    prompt = "The quick brown fox"
    contract = dataclasses.replace(m.decoding, noise="deterministic", steps=4, max_new_tokens=3 * c)
    want = offline.generate([m.tokenizer.encode(prompt)], contract)[0]
    srv = Server(tmp_path, [KEY], sections={"model": "tiny-dgemma"}, max_batch_size=2,
                 prefill_chunk=16)
    try:
        client = srv.openai_client()
        settings = {"noise": "deterministic", "steps": 4}
        got = client.completions.create(model="tiny-dgemma", prompt=prompt, max_tokens=3 * c,
                                        extra_body={"decoding": settings})
        assert got.choices[0].text == want.text and got.usage.completion_tokens == 3 * c
        greedy = client.completions.create(  # temperature 0: the contract's argmax draws
            model="tiny-dgemma", prompt=prompt, max_tokens=3 * c, temperature=0, top_p=1,
            extra_body={"decoding": {"steps": 4}})
        assert greedy.choices[0].text == want.text
        chunks = list(client.completions.create(
            model="tiny-dgemma", prompt=prompt, stream=True, max_tokens=3 * c,
            extra_body={"decoding": settings}))
        assert "".join(ch.choices[0].text for ch in chunks) == want.text
        # one chunk per canvas (the detokenizer may hold back a canvas's text that ends inside
        # a character), then the finish
        assert [ch.choices[0].finish_reason for ch in chunks] == [None, None, None, "length"]
        cut = want.text[len(want.text) // 2:][:3]
        stopped = client.completions.create(model="tiny-dgemma", prompt=prompt, max_tokens=3 * c,
                                            stop=[cut], extra_body={"decoding": settings})
        assert stopped.choices[0].text == want.text[: want.text.index(cut)]
        assert stopped.choices[0].finish_reason == "stop"
        chat = [client.chat.completions.create(
            model="tiny-dgemma", messages=[{"role": "user", "content": "hi"}], n=2, seed=5,
            max_tokens=c, extra_body={"decoding": {"steps": 3}}) for _ in range(2)]
        texts = [[ch.message.content for ch in r.choices] for r in chat]
        assert texts[0] == texts[1] and texts[0][0] != texts[0][1]
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60) as http:
            for body, param in [({"decoding": {"entropy_bound": 0}}, "decoding.entropy_bound"),
                                ({"decoding": {"t_min": 0.9}}, "decoding.t_max"),
                                ({"decoding": {"steps": 0}}, "decoding.steps"),
                                ({"decoding": {"t_max": 1e300}}, "decoding.t_max"),
                                ({"decoding": {"threshold": 0.9}}, "decoding"),
                                ({"temperature": 0.7}, "temperature"),
                                ({"logprobs": 2}, "logprobs"),
                                ({"response_format": {"type": "json_object"}}, "response_format")]:
                r = http.post("/v1/completions", json={"prompt": prompt, **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = http.post("/generate", json={"segments": [prompt, prompt], "max_new_tokens": 3 * c,
                                             "decoding": settings})
            assert r.status_code == 200 and r.json()["output"] == [want.text] * 2, r.text
            assert r.json()["segments"][0]["nfe"] == want.nfe
            schema = http.get("/openapi.json").json()["components"]["schemas"]["DecodeConfig"]
            assert {"entropy_bound", "t_min", "t_max", "noise"} <= set(schema["properties"])
        metrics = srv.metrics()  # the service's metrics read the canvas engine's stats
        assert metrics["mbd_generated_tokens_total"] >= 7 * c and metrics["mbd_busy_rows"] == 0
        assert metrics["mbd_decode_forwards_total"] > 0 and metrics["mbd_engine_failures_total"] == 0
        assert metrics["mbd_kv_buffer_usage_ratio"] == 0.0
    finally:
        srv.stop()


MESH_SCRIPT = """
import dataclasses, json
import jax, numpy as np
from mbd_jax import canvas_model, compile_stats
from mbd_jax.config.diffusion_gemma import CanvasDecoding
from mbd_jax.engine.canvas_engine import CanvasEngine
from mbd_jax.parallel.mesh import make_mesh

compile_stats.install()
m = canvas_model.load("tiny-dgemma")
rng = np.random.default_rng(0)
prompts = [rng.integers(3, m.cfg.vocab_size, n).tolist() for n in (5, 21, 9)]
d = CanvasDecoding(noise="deterministic", steps=4, max_new_tokens=40, buffer_size=2)
decodings = [d, dataclasses.replace(d, buffer_size=1), dataclasses.replace(d, steps=6)]
out = {}
for name, sizes in [("one", None), ("mesh", {"data": 2, "expert": 2, "tensor": 2})]:
    mesh = None if sizes is None else make_mesh(sizes)
    e = CanvasEngine(m.cfg, m.params, batch_size=2, page_size=16, max_len=128,
                     prefill_chunk=16, mesh=mesh)
    e.warmup()
    before = compile_stats.compiles()
    out[name] = [r.token_ids for r in e.generate(prompts, decodings)]
    out[name + "_compiles"] = compile_stats.compiles() - before
ex = e.params["layers"][0]["experts"]["gate"].sharding.spec
q = e.params["layers"][0]["attn"]["q"].sharding.spec
pool = e._layers[0]["k"].sharding.spec
out["specs"] = [list(map(str, ex)), list(map(str, q)), list(map(str, pool))]
print(json.dumps(out))
"""


def test_the_engine_on_a_mesh_decodes_like_one_device():
    """tiny-dgemma on a data=2 x expert=2 x tensor=2 mesh of CPU devices: experts split on
    `expert`, heads and the pool's KV heads on `tensor`; the same tokens as one device under
    the contract (three rows through two, both commit schedules) and no compiles after the
    warm-up on either."""
    from tests.conftest import run_on_8_cpu_devices

    out = run_on_8_cpu_devices(MESH_SCRIPT)
    assert out["mesh"] == out["one"] and all(len(t) == 40 for t in out["one"])
    assert out["one_compiles"] == 0 and out["mesh_compiles"] == 0
    experts, q, pool = out["specs"]
    assert experts[0] == "expert" and q[1] == "tensor" and pool[2] == "tensor"


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_eight_bit_weights_compute_what_their_scaled_values_compute(scheme):
    """tiny-dgemma quantized as it loads: every weight matrix (attention, dense MLP, experts,
    self-conditioning) held in 8 bits with a float32 scale per output channel, the embedding,
    norms and router in float; a decoder pass (over an encoded prompt, with self-conditioning)
    equals the float model's given the dequantized weights q * scale, and the engine serves it
    with the weights still 8-bit on the device."""
    import jax.numpy as jnp

    from mbd_jax import canvas_model
    from mbd_jax.model import diffusion_gemma as dg
    from mbd_jax.model.quantize import SCHEMES

    m = canvas_model.load("tiny-dgemma", quantization=scheme)
    cfg, q = m.cfg, m.params
    layer = q["layers"][2]
    assert layer["experts"]["down"].dtype == SCHEMES[scheme].dtype
    assert layer["attn"]["o_scale"].shape == (1, cfg.hidden_size)
    assert q["embed"].dtype == jnp.float32 and layer["router"]["expert_scale"].dtype == jnp.float32
    dequantized = _dequantize(q)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 40)), jnp.int32)
    canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, cfg.canvas_length)), jnp.int32)
    soft = jnp.asarray(rng.normal(size=(2, cfg.canvas_length, cfg.hidden_size)), jnp.float32)
    logits = []
    for params in (q, dequantized):
        cache = dg.encode(params, cfg, prompt, jnp.zeros(2, jnp.int32),
                          dg.allocate_cache(cfg, 2, 64))
        logits.append(np.asarray(dg.decode(params, cfg, canvas, jnp.full(2, 40), cache, soft,
                                           jnp.ones(2, bool))))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5)
    engine = CanvasEngine(cfg, q, batch_size=1, page_size=16, max_len=96, prefill_chunk=16)
    engine.warmup()
    out = engine.generate([prompt[0].tolist()], dataclasses.replace(CONTRACT, max_new_tokens=32))
    assert len(out[0].token_ids) == 32
    assert engine.params["layers"][0]["mlp"]["gate"].dtype == SCHEMES[scheme].dtype


def _dequantize(tree):
    """Each 8-bit weight times its scale, in float32; the scales dropped."""
    from mbd_jax.model.quantize import SCALE_SUFFIX, dequantize

    if isinstance(tree, list):
        return [_dequantize(x) for x in tree]
    out = {}
    for name, leaf in tree.items():
        if isinstance(leaf, (dict, list)):
            out[name] = _dequantize(leaf)
        elif name + SCALE_SUFFIX in tree:
            out[name] = dequantize(leaf, tree[name + SCALE_SUFFIX], np.float32)
        elif not (name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tree):
            out[name] = leaf
    return out


@pytest.mark.parametrize("scheme", ["none", "fp8"])
def test_the_grouped_expert_path_equals_the_dense_one(scheme):
    """A GPU's expert path (grouped matmuls over the hit experts, ragged_dot; 8-bit weights as
    they are, scaled per sorted row) runs here too: a decoder pass equals the dense path's."""
    import jax.numpy as jnp

    from mbd_jax import canvas_model
    from mbd_jax.model import diffusion_gemma as dg

    m = canvas_model.load("tiny-dgemma", quantization=scheme)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(3, m.cfg.vocab_size, (2, 24)), jnp.int32)
    canvas = jnp.asarray(rng.integers(3, m.cfg.vocab_size, (2, m.cfg.canvas_length)), jnp.int32)
    soft = jnp.zeros((2, m.cfg.canvas_length, m.cfg.hidden_size), jnp.float32)
    out = []
    for platform in ("cpu", "gpu"):
        cfg = dataclasses.replace(m.cfg, platform=platform)
        cache = dg.encode(m.params, cfg, prompt, jnp.zeros(2, jnp.int32),
                          dg.allocate_cache(cfg, 2, 48))
        out.append(np.asarray(dg.decode(m.params, cfg, canvas, jnp.full(2, 24), cache, soft,
                                        jnp.zeros(2, bool))))
    np.testing.assert_allclose(out[0], out[1], atol=1e-5)
