"""Writes a synthetic Hugging Face checkpoint (Qwen3 architecture, random bf16 weights, sharded
safetensors + index) for conversion benchmarks.

    python tools/synthetic_checkpoint.py --out /tmp/synth-1b [--hidden 2048 --layers 16 ...]

Default shape: ~0.94B parameters (hidden 2048, 16 layers, 16/8 heads x 128, MLP 6144, vocab 32000).
"""

import json
import pathlib

import torch
from safetensors.torch import save_file
import harness  # tools/harness.py, beside this file


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=500)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d, h, k, dh, f = args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": args.vocab,
              "hidden_size": d, "num_hidden_layers": args.layers, "num_attention_heads": h,
              "num_key_value_heads": k, "head_dim": dh, "intermediate_size": f,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 0,
              "mask_token_id": 3, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    shapes = {"model.embed_tokens.weight": (args.vocab, d), "model.norm.weight": (d,),
              "lm_head.weight": (args.vocab, d)}
    for i in range(args.layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
                       f"{p}.self_attn.q_proj.weight": (h * dh, d), f"{p}.self_attn.k_proj.weight": (k * dh, d),
                       f"{p}.self_attn.v_proj.weight": (k * dh, d), f"{p}.self_attn.o_proj.weight": (d, h * dh),
                       f"{p}.self_attn.q_norm.weight": (dh,), f"{p}.self_attn.k_norm.weight": (dh,),
                       f"{p}.mlp.gate_proj.weight": (f, d), f"{p}.mlp.up_proj.weight": (f, d),
                       f"{p}.mlp.down_proj.weight": (d, f)})
    g = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name))
            weight_map.update({t: name for t in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= args.shard_mb * 2**20:
            flush()
    flush()
    total = sum(torch.Size(s).numel() for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}))
    print(json.dumps({"out": str(out), "parameters": total, "bytes": total * 2, "shards": n}))


if __name__ == "__main__":
    main()
