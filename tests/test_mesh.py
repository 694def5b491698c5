"""The device mesh on 8 forced CPU devices: --mesh parsing, the rules table, parameters and KV
buffers that really are split, expert parallelism (forward equality and the collectives in the
compiled program), sharded generation and sharded checkpoint restore onto other mesh shapes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from mbd_jax.errors import UserError
from mbd_jax.parallel import mesh as meshlib
from tests.conftest import ROOT, run_on_8_cpu_devices


def test_parse_mesh_fills_and_names_mistakes():
    assert meshlib.parse_mesh("data=1,expert=4,tensor=2", 8) == {"data": 1, "expert": 4, "tensor": 2}
    assert meshlib.parse_mesh("expert=-1,tensor=2", 8) == {"data": 1, "expert": 4, "tensor": 2}
    assert meshlib.parse_mesh("", 1) == {"data": 1, "expert": 1, "tensor": 1}
    for spec, needle in [("pipe=2", "unknown axis 'pipe'"), ("data=x", "needs an integer"),
                         ("data=-1,tensor=-1", "at most one axis"), ("tensor=3", "needs 3 devices"),
                         ("tensor=-1,data=3", "do not split by 3"), ("data=0", ">= 1 or -1")]:
        with pytest.raises(UserError, match=needle):
            meshlib.parse_mesh(spec, 8)


FORWARD = textwrap.dedent("""
    import json, re, jax, numpy as np
    from mbd_jax.model import sharding
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask, init_params
    from mbd_jax.parallel import mesh as meshlib
    from tests.conftest import layer_1, tiny_cfg
    assert jax.device_count() == 8
    out = []
    # Every mesh shape for one path; two shapes (expert alone, expert with tensor) for the others;
    # the tiled rows scan their layers (stacked parameters and shard_map inside the scan).
    # block routing (pool 3 of 8 experts per 8-token window) on the ragged and looped paths
    for router, impl, shapes, pool in (
            ("sigmoid_grouped", "ragged", ((1, 1, 8), (1, 8, 1), (2, 2, 2), (1, 4, 2)), 0),
            ("softmax_topk", "tiled", ((1, 8, 1), (2, 2, 2)), 0),
            ("softmax_topk", "looped", ((1, 8, 1), (1, 4, 2)), 0),
            ("sigmoid_grouped", "ragged", ((2, 2, 2),), 3),
            ("softmax_topk", "looped", ((1, 4, 2),), 3)):
        grouped = router == "sigmoid_grouped"
        cfg = tiny_cfg(router=router, moe_impl=impl, num_heads=8, num_kv_heads=8,
                       n_group=4 if grouped else 1, topk_group=2 if grouped else 1,
                       layer_loop="scan" if impl == "tiled" else "unrolled",
                       router_block_pool=pool)
        params = init_params(cfg)
        rng = np.random.default_rng(0)
        tokens = rng.integers(5, cfg.vocab_size, size=(2, 24)).astype(np.int32)
        pos = np.tile(np.arange(24, dtype=np.int32), (2, 1))
        meta = ForwardMeta.explicit(pos, block_causal_mask(pos, cfg.block_size))
        ref = np.asarray(jax.jit(lambda p: Transformer(cfg).apply({"params": p}, tokens,
                                                                   meta)[0])(params))
        for shape in shapes:
            m = meshlib.make_mesh(dict(zip(meshlib.AXES, shape)))
            sharded = jax.device_put(params, sharding.param_shardings(cfg, m))
            fwd = jax.jit(lambda p, t, q: Transformer(cfg, m).apply(
                {"params": p}, t, ForwardMeta.explicit(q, meta.mask))[0])
            compiled = fwd.lower(sharded, tokens, pos).compile()  # compiled once: run and read
            got = np.asarray(compiled(sharded, tokens, pos))
            hlo = compiled.as_text()
            # per-layer shapes (a scanned run stacks its layers on a leading axis)
            experts = layer_1(sharded)["moe"]["experts_up"]
            q = (sharded.get("layer_0") or sharded["layers_0_1"])["attn"]["q_proj"]
            kv = jax.tree.leaves(sharding.cache_shardings(cfg, m, 2, 64))[0]  # scan: all layers
            out.append({"router": router, "impl": impl, "mesh": shape, "pool": pool,
                        "err": float(np.abs(got - ref).max()),
                        "experts_local": list(experts.addressable_shards[0].data.shape)[-3:],
                        "experts_global": list(experts.shape)[-3:],
                        "q_local": list(q.addressable_shards[0].data.shape)[-3:],
                        "kv_local": list(kv.shard_shape(
                            (cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim)[
                                0 if impl == "tiled" else 1:]))[-4:],
                        "hidden": cfg.hidden_size,
                        "all_reduce": re.findall(r"= (f32\\[[0-9,]+\\])[^ ]* all-reduce\\(", hlo),
                        "all_gather": re.findall(r"= (f32\\[[0-9,]+\\])[^ ]* all-gather\\(", hlo)})
    print(json.dumps(out))
""")


def test_expert_parallel_forward_equals_unsharded_on_8_cpu_devices():
    """The forward under a mesh (experts in shard_map, the rest partitioned by XLA) equals the
    one-device forward, for both routers, on four mesh shapes, with block routing too; parameters
    and the KV buffer are really split; the compiled program combines the experts with an
    all-reduce of the [N, D] outputs and never gathers the expert weights. Block routing keeps
    the same activation all-reduces (the combine is one all-reduce whatever the routing: what
    the pool saves is expert weight reads, docs/performance.md); it only changes the small
    routing collectives ([N, E] scores)."""
    rows = run_on_8_cpu_devices(FORWARD)
    assert len(rows) == 10
    size = lambda shape: math.prod(int(n) for n in shape[4:-1].split(","))  # noqa: E731
    key = lambda r: (r["router"], r["impl"], tuple(r["mesh"]))  # noqa: E731
    plain = {key(r): r for r in rows if r["pool"] == 0}
    for row in rows:
        if row["pool"] and key(row) in plain:
            wide = lambda r: sorted(x for x in r["all_reduce"] if size(x) > 2 * 24 * 8)  # noqa: E731
            assert wide(row) == wide(plain[key(row)]), row
            assert all(size(x) <= 2 * 24 * 8 for x in row["all_reduce"] + row["all_gather"]
                       if x not in plain[key(row)]["all_reduce"]), row
    for row in rows:
        data, expert, tensor = row["mesh"]
        assert row["err"] < 2e-5, row  # float32; only the order of sums differs
        e, d, f = row["experts_global"]
        assert row["experts_local"] == [e // expert, d, f // tensor], row
        assert row["q_local"][1] == 8 // tensor, row  # heads split on tensor
        assert row["kv_local"] == [2, 64, 8 // tensor, 16], row  # KV pages: on every data shard
        assert 2 * 24 // data * row["hidden"] in map(size, row["all_reduce"]), row  # the combine
        for shape in row["all_gather"]:  # routing logits may be gathered, expert weights never
            assert size(shape) < d * f, row


ENGINE = textwrap.dedent("""
    import json, jax, numpy as np
    from mbd_jax import compile_stats
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig, Structure
    from mbd_jax.engine import Engine
    from mbd_jax.parallel import mesh as meshlib
    prompts = [[1, 20, 31, 42, 53, 64, 75], [1, 9, 8, 7], [1, 100, 200, 300, 33, 44, 55, 66, 77],
               [1, 5]]
    decode = DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True)  # all 24 tokens
    schema = {"type": "object", "properties": {"sorted": {"type": "array", "maxItems": 4,
              "items": {"type": "integer", "minimum": 0, "maximum": 99}}},
              "required": ["sorted"], "additionalProperties": False}
    constrained = [DecodeConfig(buffer_size=2, max_new_tokens=48, temperature=t, seed=3,
                                structure=s) for t, s in [
        (0.0, Structure.json_schema(schema)), (1.0, Structure("regex", "[a-z]{3,9}")),
        (0.0, None), (0.5, Structure.json_schema(schema))]]
    sampling = [DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True, temperature=t,
                             top_k=k, top_p=p, seed=s) for t, k, p, s in [
        (1.0, 0, 1.0, 1), (0.8, 5, 1.0, 2), (1.2, 0, 0.7, 3), (1.0, 12, 0.9, 4)]]
    def run(mesh, loop="unrolled"):
        model = load_model("tiny-mbd", mesh=mesh, runtime={"layer_loop": loop})
        # row_prefill_min 8: the 9-token prompt's chunk runs over its own row, the rest share
        engine = Engine(model.cfg, model.params, batch_size=4, buffer_size=2, prefill_chunk=16,
                        mesh=mesh, row_prefill_min=8, tokenizer=model.tokenizer)
        engine.warmup(buckets=engine.prefill_buckets_for(prompts))  # what the prompts run
        first = [r.token_ids for r in engine.generate(prompts, decode)]
        c0 = compile_stats.compiles()
        again = [r.token_ids for r in engine.generate(prompts[::-1], decode)][::-1]
        structured = [r.text for r in engine.generate(prompts, constrained)]
        sampled = [r.token_ids for r in engine.generate(prompts, sampling)]
        layer_1 = engine.params.get("layer_1") or engine.params["layers_1_4"]  # scan: stacked
        experts = layer_1["moe"]["experts_up"]
        return {"tokens": first, "again": again, "compiles": compile_stats.compiles() - c0,
                "structured": structured, "sampled": sampled,
                "kv_local": list(jax.tree.leaves(engine.kv)[0].addressable_shards[0].data.shape)[-4:],
                "kv_global": list(jax.tree.leaves(engine.kv)[0].shape)[-4:],
                "kv_stacked": engine.kv.positional.stacked,
                "experts_local": list(experts.addressable_shards[0].data.shape)[-3:]}
    out = {"one": run(None)}
    # the layers scanned: the checkpoint restored shard by shard, then stacked under the mesh
    # (unrolled layers under a mesh: the sharded hybrid below and tests/test_multihost.py)
    out["scan: data=2,expert=2,tensor=2"] = run(
        meshlib.make_mesh(meshlib.parse_mesh("data=2,expert=2,tensor=2")), "scan")
    print(json.dumps(out))
""")


def test_sharded_engine_generates_the_same_tokens():
    """The shipped tiny-mbd generates identical tokens on an 8-device (data, expert, tensor) mesh
    as on one device (greedy, constrained, and seeded sampling with temperature, top-k, top-p), its layers scanned under the mesh, its KV buffer and experts split and
    nothing compiled after warm-up (constrained rows among them)."""
    out = run_on_8_cpu_devices(ENGINE)
    one = out.pop("one")
    assert [len(t) for t in one["tokens"]] == [24] * 4
    assert json.loads(one["structured"][0])["sorted"] is not None, one["structured"]
    for spec, got in out.items():
        assert got["tokens"] == one["tokens"], spec
        assert got["again"] == one["tokens"], spec
        assert got["structured"] == one["structured"], spec
        assert got["sampled"] == one["sampled"], spec  # top-k / top-p searched on the shards
        assert got["compiles"] == 0, spec
        sizes = meshlib.parse_mesh(spec.removeprefix("scan: "), 8)
        p, page, k, dh = got["kv_global"]  # tiny-moe: 2 KV heads, 8 experts of width 128
        assert got["kv_local"] == [p, page, k // sizes["tensor"], dh], spec  # pages: every shard
        assert got["kv_stacked"] == spec.startswith("scan"), spec  # the form follows the loop
        assert got["experts_local"] == [8 // sizes["expert"], 128, 128 // sizes["tensor"]], spec


RESTORE = textwrap.dedent("""
    import json, sys, jax, numpy as np
    from mbd_jax.checkpoint import load_model, save_model
    from mbd_jax.model import sharding
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask, init_params
    from mbd_jax.parallel import mesh as meshlib
    from tests.conftest import layer_1, tiny_cfg
    cfg = tiny_cfg(num_heads=8, num_kv_heads=8, n_group=4, topk_group=2, tokenizer=None)
    write = meshlib.make_mesh(meshlib.parse_mesh("expert=4,tensor=2"))
    params = init_params(cfg, mesh=write)  # each device computes its own shards
    save_model(sys.argv[1], cfg, params)
    tokens = np.arange(5, 29, dtype=np.int32).reshape(1, 24)
    pos = np.arange(24, dtype=np.int32)[None]
    meta = ForwardMeta.explicit(pos, block_causal_mask(pos, cfg.block_size))
    def logits(mesh, p):
        return np.asarray(jax.jit(lambda p: Transformer(cfg, mesh).apply(
            {"params": p}, tokens, meta)[0])(p))
    ref = logits(write, params)
    one = init_params(cfg, mesh=meshlib.make_mesh(meshlib.parse_mesh("data=1", 1), jax.devices()[:1]))
    out = {"init_err": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                           for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one)))}
    for spec in ("data=2,expert=2,tensor=2", "tensor=8", "data=1"):
        mesh = meshlib.make_mesh(meshlib.parse_mesh(spec, 8 if spec != "data=1" else 1),
                                 jax.devices()[: 1 if spec == "data=1" else 8])
        loaded = load_model(sys.argv[1], mesh=mesh).params
        want = sharding.param_shardings(cfg, mesh)
        placed = all(a.sharding == w for a, w in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)))
        up = layer_1(loaded)["moe"]["experts_up"]
        out[spec] = {"err": float(np.abs(logits(mesh, loaded) - ref).max()), "placed": placed,
                     "experts_local": list(up.addressable_shards[0].data.shape)[-3:]}
    print(json.dumps(out))
""")


def test_sharded_checkpoint_restores_onto_other_meshes(tmp_path):
    """Parameters drawn and written shard by shard from an (expert 4, tensor 2) mesh equal the
    ones drawn on one device, and restore straight into the shardings of other mesh shapes (and
    one device) with the same logits."""
    out = run_on_8_cpu_devices(RESTORE.replace("sys.argv[1]", repr(str(tmp_path / "m"))))
    assert out.pop("init_err") == 0.0  # random init draws the same values sharded or not
    assert set(out) == {"data=2,expert=2,tensor=2", "tensor=8", "data=1"}
    for spec, row in out.items():
        assert row["placed"], spec
        assert row["err"] < 2e-5, (spec, row)
    assert out["data=2,expert=2,tensor=2"]["experts_local"][0] == 4  # 8 experts over 2
    assert out["data=1"]["experts_local"][0] == 8


def test_rules_leave_undivisible_dims_replicated():
    import jax

    m = meshlib.make_mesh({"data": 1, "expert": 1, "tensor": 1}, jax.devices()[:1])
    assert meshlib.spec_for(("heads", "mlp"), (4, 8), m) == P("tensor", None)  # one use per axis

    class Fake:  # a mesh whose tensor axis is 8 wide, for the divisibility rule alone
        shape = {"data": 1, "expert": 1, "tensor": 8}

    assert meshlib.spec_for(("embed", "heads"), (64, 4), Fake) == P(None, None)
    assert meshlib.spec_for(("embed", "heads"), (64, 16), Fake) == P(None, "tensor")


def test_mesh_bench_tool_runs_and_never_recompiles():
    """tools/bench_mesh.py on 2 forced CPU devices: one row per mesh, the same decoding (TPF) on
    each, and no compilation after warm-up."""
    r = subprocess.run([sys.executable, "tools/bench_mesh.py", "--force-cpu-devices", "2",
                        "--model", "tiny-mbd", "--meshes", "one;expert=2", "--batch", "1",
                        "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1",
                        "--prefill-chunk", "8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["mesh"] for row in rows] == ["one", "expert=2"]
    assert [row["devices"] for row in rows] == [1, 2]
    assert len({row["tpf"] for row in rows}) == 1
    assert all(row["compiles_after_warmup"] == 0 and row["tokens_per_s"] > 0 for row in rows)
    assert "vs first" in r.stderr


HYBRID = textwrap.dedent("""
    import json, jax
    from mbd_jax.config import DecodeConfig
    from mbd_jax.engine import Engine
    from mbd_jax.model import sharding
    from mbd_jax.parallel import mesh as meshlib
    from tests.test_hybrid import hybrid_cfg
    cfg, params = hybrid_cfg("bidirectional")
    prompts = [[7, 8, 9], list(range(20, 41)), [5] * 12]
    out = {}
    for spec in (None, "data=2,expert=2,tensor=2"):
        mesh = None if spec is None else meshlib.make_mesh(meshlib.parse_mesh(spec))
        p = params if mesh is None else jax.device_put(params, sharding.param_shardings(cfg, mesh))
        engine = Engine(cfg, p, batch_size=2, buffer_size=2, prefill_chunk=16, mesh=mesh)
        tokens = [r.token_ids for r in engine.generate(prompts, DecodeConfig(buffer_size=2,
                                                                             max_new_tokens=16))]
        out[str(spec)] = {"tokens": tokens,
                          "state_local": list(engine.kv.entries["linear_attention"].state[0].addressable_shards[0].data.shape),
                          "v_proj_local": list(p["layer_0"]["linear_attn"]["v_proj"]
                                               .addressable_shards[0].data.shape)}
    print(json.dumps(out))
""")


def test_sharded_hybrid_generates_the_same_tokens():
    """The Gated DeltaNet hybrid (tests/test_hybrid.py's tiny one, MultiBD) on a (data 2, expert 2,
    tensor 2) mesh generates what it does on one device, its linear-attention heads and their
    recurrent states split on `tensor`."""
    out = run_on_8_cpu_devices(HYBRID)
    one, sharded = out["None"], out["data=2,expert=2,tensor=2"]
    assert sharded["tokens"] == one["tokens"] and any(len(t) > 4 for t in one["tokens"])
    assert one["state_local"] == [2, 4, 16, 8] and sharded["state_local"] == [2, 2, 16, 8]
    assert one["v_proj_local"] == [64, 4, 8] and sharded["v_proj_local"] == [64, 2, 8]


VOCAB_COLLECTIVES = textwrap.dedent("""
    import json, re
    from mbd_jax.engine import deviceless
    from mbd_jax.parallel import mesh as meshlib
    from tests.conftest import tiny_cfg
    cfg = tiny_cfg()
    mesh = meshlib.make_mesh({"data": 1, "expert": 1, "tensor": 2})
    shape = deviceless.EngineShape(batch_size=2, buffer_size=2, prefill_chunk=16)
    text = deviceless.compile_engine(cfg, mesh, shape)["decode"].compiled.as_text()
    out = []
    for line in text.splitlines():
        m = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                      r"collective-permute)\\(", line)
        if m:
            dims = [int(d) for s in re.findall(r"\\[([\\d,]*)\\]", m.group(1))
                    for d in s.split(",") if d]
            op = re.search(r'op_name="([^"]*)"', line)
            out.append({"kind": m.group(2), "dims": dims, "op": op.group(1) if op else ""})
    print(json.dumps({"vocab": cfg.vocab_size, "collectives": out}))
""")


def test_the_vocabulary_never_leaves_its_tensor_shard():
    """The decode program on a tensor=2 mesh (the LM head's vocabulary split in two): greedy
    argmax, the confidences, temperature sampling (Gumbel-max) and the top-k / top-p cutoffs
    (binary searches) reduce over the vocabulary shard by shard. No collective outside the
    model carries a vocabulary-sized dimension; each is an all-reduce of one value per window
    position, and a greedy step makes three (max, argmax, the softmax's sum): per position 3
    values cross the mesh where gathering the logits would move the whole vocabulary."""
    got = run_on_8_cpu_devices(VOCAB_COLLECTIVES)
    vocab, collectives = got["vocab"], got["collectives"]
    b, w = 2, 16  # the engine shape's rows and window (N_buf 2 x blk 8)
    policy = [c for c in collectives if "Transformer" not in c["op"]]
    assert policy and not any(vocab in c["dims"] for c in collectives), collectives
    assert all(c["kind"] == "all-reduce" and c["dims"][:2] == [b, w] for c in policy), policy
    greedy = [c for c in policy if "branch" not in c["op"]]  # outside the sampling branches
    per_loop = len(greedy) // 2  # the loop body is compiled for each window width in use
    assert per_loop == 3 and sorted(c["op"].rsplit("/", 1)[1] for c in greedy[:3]) == [
        "reduce_max", "reduce_min", "reduce_sum"], greedy
    gathered = b * w * vocab * 4  # bytes: the logits of one step, gathered
    reduced = sum(4 * math.prod(c["dims"]) for c in greedy[:3])
    assert gathered / reduced == vocab / 3