"""The device mesh (first slice of the mesh issue): --mesh parsing, the rules table, and sharded
parameters / KV buffers that really are split, with a sharded forward equal to the unsharded one
on 8 forced CPU devices for both router types."""

from __future__ import annotations

import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from mbd_jax.errors import UserError
from mbd_jax.parallel import mesh as meshlib
from tests.conftest import run_on_8_cpu_devices


def test_parse_mesh_fills_and_names_mistakes():
    assert meshlib.parse_mesh("data=1,expert=4,tensor=2", 8) == {"data": 1, "expert": 4, "tensor": 2}
    assert meshlib.parse_mesh("expert=-1,tensor=2", 8) == {"data": 1, "expert": 4, "tensor": 2}
    assert meshlib.parse_mesh("", 1) == {"data": 1, "expert": 1, "tensor": 1}
    for spec, needle in [("pipe=2", "unknown axis 'pipe'"), ("data=x", "needs an integer"),
                         ("data=-1,tensor=-1", "at most one axis"), ("tensor=3", "needs 3 devices"),
                         ("tensor=-1,data=3", "do not split by 3"), ("data=0", ">= 1 or -1")]:
        with pytest.raises(UserError, match=needle):
            meshlib.parse_mesh(spec, 8)


SCRIPT = textwrap.dedent("""
    import dataclasses, json, jax, numpy as np
    from jax.sharding import NamedSharding
    from mbd_jax.model.transformer import Transformer, block_causal_mask, init_params
    from mbd_jax.parallel import mesh as meshlib
    from tests.conftest import tiny_cfg
    assert jax.device_count() == 8
    out = []
    for router in ("sigmoid_grouped", "softmax_topk"):
        cfg = tiny_cfg(router=router, num_heads=8, num_kv_heads=8, n_group=4 if
                       router == "sigmoid_grouped" else 1, topk_group=2 if
                       router == "sigmoid_grouped" else 1)
        params = init_params(cfg)
        rng = np.random.default_rng(0)
        tokens = rng.integers(5, cfg.vocab_size, size=(2, 24)).astype(np.int32)
        pos = np.tile(np.arange(24, dtype=np.int32), (2, 1))
        mask = block_causal_mask(pos, cfg.block_size)
        fwd = jax.jit(lambda p, t, q, m: Transformer(cfg).apply({"params": p}, t, q, mask=m)[0])
        ref = np.asarray(fwd(params, tokens, pos, mask))
        for shape in ((1, 1, 8), (1, 8, 1), (2, 2, 2), (1, 4, 2)):
            m = meshlib.make_mesh(dict(zip(meshlib.AXES, shape)))
            shardings = meshlib.param_shardings(cfg, m)
            sharded = jax.device_put(params, shardings)
            batch = NamedSharding(m, meshlib.spec_for(("batch", None), tokens.shape, m))
            got = np.asarray(fwd(sharded, jax.device_put(tokens, batch),
                                 jax.device_put(pos, batch), mask))
            experts = sharded["layer_1"]["moe"]["experts_up"]
            q = sharded["layer_0"]["attn"]["q_proj"]
            kv = meshlib.kv_sharding(cfg, m, 2, 64)
            out.append({"router": router, "mesh": shape,
                        "err": float(np.abs(got - ref).max()),
                        "experts_local": list(experts.addressable_shards[0].data.shape),
                        "experts_global": list(experts.shape),
                        "q_local": list(q.addressable_shards[0].data.shape),
                        "kv_local": list(kv.shard_shape((2, 64, cfg.num_kv_heads, cfg.head_dim)))})
    print(json.dumps(out))
""")


def test_sharded_forward_equals_unsharded_on_8_cpu_devices():
    rows = run_on_8_cpu_devices(SCRIPT)
    assert len(rows) == 8
    for row in rows:
        data, expert, tensor = row["mesh"]
        assert row["err"] < 2e-5, row  # float32; only the order of sums differs
        e, d, f = row["experts_global"]
        assert row["experts_local"] == [e // expert, d, f // tensor], row
        assert row["q_local"][1] == 8 // tensor, row  # heads split on tensor
        assert row["kv_local"] == [2 // data, 64, 8 // tensor, 16], row


def test_rules_leave_undivisible_dims_replicated():
    import jax

    m = meshlib.make_mesh({"data": 1, "expert": 1, "tensor": 1}, jax.devices()[:1])
    assert meshlib.spec_for(("heads", "mlp"), (4, 8), m) == P("tensor", None)  # one use per axis

    class Fake:  # a mesh whose tensor axis is 8 wide, for the divisibility rule alone
        shape = {"data": 1, "expert": 1, "tensor": 8}

    assert meshlib.spec_for(("embed", "heads"), (64, 4), Fake) == P(None, None)
    assert meshlib.spec_for(("embed", "heads"), (64, 16), Fake) == P(None, "tensor")
