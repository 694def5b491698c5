"""mbd-jax against a plain PyTorch block-diffusion loop on the same weights, same prompts.

    python tools/bench_vs_torch.py [--kinds moe,dense] [--batch 1,16] [--new-tokens 64]
                                   [--repeats 5] [--layers 6] [--hidden 384]

For each kind a transformers model is built with random weights (Qwen3-MoE: 16 experts top-4 of
width 256; dense Qwen3: MLP width 1024; 6 layers, hidden 384, vocab 4000 by default), saved with
`save_pretrained`, and converted with `mbd-jax convert` (float32, block 4). Both sides then run
SingleBD, greedy, exactly one token per step (fixed_steps with block_size steps), 64 new tokens:

- PyTorch: eager transformers with a `DynamicCache`, one block at a time. Each step forwards the
  block's tokens over the cached prefix (a 4-D mask that lets the block see itself and the
  prefix) and fills the most confident masked position per row; the block's keys are cropped
  from the cache after each step; a finished block gets one storing forward.
- mbd-jax: `Engine.generate` with the same decode settings (warmed up first).

Runs alternate (torch, ours, torch, ours, ...) and medians are reported. Outputs are compared
token for token up to each row's EOS. Prints JSON (stdout) and a table (stderr).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
import time
import typing

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent

from mbd_jax.config import MoeImpl  # noqa: E402  (after the path)
import harness  # tools/harness.py, beside this file

VOCAB, BLOCK = 4000, 4
MASK_ID, EOS_ID = VOCAB - 1, VOCAB - 2


def build_hf(kind: str, out: pathlib.Path, layers: int, hidden: int, seed: int = 0) -> pathlib.Path:
    """A random transformers model saved with save_pretrained (what `convert` reads)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64,
                  intermediate_size=1024, max_position_embeddings=1024, eos_token_id=EOS_ID,
                  pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=16, num_experts_per_tok=4,
                                                    moe_intermediate_size=256, norm_topk_prob=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that argmax is decided, not a near-tie
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def torch_generate(model, prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
    """SingleBD, greedy, one token per step, DynamicCache; prompts [B, P] with P % BLOCK == 0."""
    import torch
    from transformers import DynamicCache

    b, p = prompts.shape
    neg = torch.finfo(torch.float32).min
    cache = DynamicCache()
    with torch.no_grad():
        pos = torch.arange(p)
        seen = pos[None, :] < (pos[:, None] // BLOCK + 1) * BLOCK  # block-causal prompt
        model(input_ids=torch.from_numpy(prompts), past_key_values=cache, use_cache=True,
              attention_mask=torch.where(seen, 0.0, neg)[None, None].expand(b, 1, p, p),
              position_ids=pos[None].expand(b, p))
        out = np.zeros((b, 0), np.int64)
        done = np.zeros(b, bool)
        for start in range(p, p + new_tokens, BLOCK):
            block = torch.full((b, BLOCK), MASK_ID, dtype=torch.long)
            positions = torch.arange(start, start + BLOCK)[None].expand(b, BLOCK)
            see_all = torch.zeros((b, 1, BLOCK, start + BLOCK))  # the prefix and the whole block
            for _ in range(BLOCK):
                logits = model(input_ids=block, past_key_values=cache, use_cache=True,
                               attention_mask=see_all, position_ids=positions).logits
                cache.crop(-BLOCK)  # a refining forward stores nothing (drop its keys)
                logits[..., MASK_ID] = neg
                probs = torch.softmax(logits.float(), dim=-1)
                conf, tok = probs.max(dim=-1)
                conf = torch.where(block == MASK_ID, conf, -1.0)
                pick = conf.argmax(dim=-1)  # the most confident masked position per row
                rows = torch.arange(b)
                block[rows, pick] = tok[rows, pick]
            model(input_ids=block, past_key_values=cache, use_cache=True,  # the storing forward
                  attention_mask=see_all, position_ids=positions)
            out = np.concatenate([out, block.numpy()], axis=1)
            done |= (block.numpy() == EOS_ID).any(axis=1)
            if done.all():
                break
    return [until_eos(row.tolist()) for row in out]


def until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids


def run_kind(kind: str, batches: list[int], args, tmp: pathlib.Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig
    from mbd_jax.convert import convert
    from mbd_jax.engine import Engine

    src = build_hf(kind, tmp / f"hf-{kind}", args.layers, args.hidden)
    convert(src, tmp / f"mbd-{kind}", dtype="float32", mask_token_id=MASK_ID, block_size=BLOCK,
            progress=False)
    ours = load_model(str(tmp / f"mbd-{kind}"), runtime={"moe_impl": args.moe_impl})
    theirs = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    params = sum(p.numel() for p in theirs.parameters())
    decode = DecodeConfig(buffer_size=1, policy="fixed_steps", steps_per_block=BLOCK,
                          max_new_tokens=args.new_tokens, max_nfe=4 * args.new_tokens)
    rng = np.random.default_rng(1)
    rows = []
    for b in batches:
        prompts = rng.integers(5, VOCAB - 8, size=(b, args.prompt_len))
        engine = Engine(ours.cfg, ours.params, batch_size=b, buffer_size=1,
                        prefill_chunk=max(BLOCK, args.prompt_len // BLOCK * BLOCK))
        t0 = time.perf_counter()
        engine.warmup()
        compile_s = time.perf_counter() - t0
        torch_generate(theirs, prompts[:, :BLOCK * 2], BLOCK)  # torch warm-up
        t_torch, t_ours, same = [], [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            want = torch_generate(theirs, prompts, args.new_tokens)
            t_torch.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = [r.token_ids for r in engine.generate(prompts.tolist(), decode)]
            t_ours.append(time.perf_counter() - t)
            same.append(sum(g == w for g, w in zip(got, want)) / b)
        tokens = sum(len(w) for w in want)
        row = {"kind": kind, "parameters": params, "batch": b, "new_tokens": args.new_tokens,
               "torch_tok_s": tokens / statistics.median(t_torch),
               "mbd_tok_s": tokens / statistics.median(t_ours),
               "torch_s": t_torch, "mbd_s": t_ours, "mbd_compile_s": compile_s,
               "rows_identical": min(same),
               "expert_path": engine.moe_paths["all rows"] if ours.cfg.num_experts else "-",
               "experts_split": engine.experts_split,
               "torch_threads": torch.get_num_threads()}
        row["speedup"] = row["mbd_tok_s"] / row["torch_tok_s"]
        rows.append(row)
        print(f"  {kind} batch {b}: torch {row['torch_tok_s']:.0f} tok/s, mbd-jax "
              f"{row['mbd_tok_s']:.0f} tok/s, identical rows {min(same):.2f}", file=sys.stderr,
              flush=True)
    return rows


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--kinds", default="moe,dense")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--moe-impl", choices=typing.get_args(MoeImpl), default="auto",
                    help="mbd-jax's expert path (default: auto, the backend's choice)")
    args = ap.parse_args()
    if args.prompt_len % BLOCK or args.new_tokens % BLOCK:
        raise SystemExit(f"--prompt-len and --new-tokens must be multiples of the block ({BLOCK})")
    batches = [int(x) for x in args.batch.split(",")]
    with tempfile.TemporaryDirectory(prefix="mbd-vs-torch-") as tmp:
        rows = [r for kind in args.kinds.split(",")
                for r in run_kind(kind, batches, args, pathlib.Path(tmp))]
    cols = ["kind", "batch", "torch_tok_s", "mbd_tok_s", "speedup", "rows_identical", "expert_path"]
    print(" ".join(f"{c:>14}" for c in cols), file=sys.stderr)
    for r in rows:
        print(" ".join(f"{r[c]:>14.3g}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols),
              file=sys.stderr)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
