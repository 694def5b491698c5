"""Does a model look values up? Recall's value tokens predicted with the answer teacher-forced.

    python docs/lab/probes/probe_recall.py --models tiny-bd,runs/x-model [--limit 200]

For each held-out recall question (chat format) one block-causal forward over prompt + answer +
EOS (padded to whole blocks) predicts the answer's value digits in two views: `values_masked`
(only the digits masked: each value's key stands right before it) and `answer_masked` (every
response position masked: the key must come from the question). Accuracy near 1/10 means no
lookup at all (a digit at chance); near 1/(pairs) means a value of the prompt but not the asked
one. Decoding plays no part, so this separates the model's lookup from the sampler's order.
Beside it, by the answer's first and second value (two-key questions have a second), the
values-masked accuracy, and the share of questions a SingleBD decode (Table 1's decoding) gets
right; and whose value each wrong second value is (the neighbouring pairs', the first key's, or
another). Prints JSON (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def probe(model: str, limit: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.evaluate import table1_decode
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask
    from mbd_jax.train import tasks
    from mbd_jax.train.trainer import encode

    m = load_model(model)
    cfg, tok = m.cfg, m.tokenizer
    eos, block = cfg.eos_token_ids[0], cfg.block_size

    @jax.jit
    def predict(params, tokens):  # tokens: [2, L] -> [2, L] argmax ids, one block-causal forward
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        meta = ForwardMeta.explicit(positions, block_causal_mask(positions, block))
        logits, _ = Transformer(cfg).apply({"params": params}, tokens, meta)
        return jnp.argmax(logits, -1)

    right = {"values_masked": [], "answer_masked": []}
    by_value: list[list[bool]] = [[], []]  # values masked: the answer's first, second value
    misses: collections.Counter = collections.Counter()  # whose value a wrong second one is
    questions = list(itertools.islice(
        tasks.examples(["recall"], seed=1, split="heldout", fmt="chat"), limit))
    for ex in questions:
        ids, prompt_len = encode(tok, ex, eos)
        length = -(-len(ids) // block) * block
        ids = np.array(ids + [eos] * (length - len(ids)), np.int32)
        values = [i for i in range(prompt_len, len(ids))
                  if tok.decode([int(ids[i])]).strip().isdigit()]  # the answer's value digits
        views = np.stack([ids, ids])
        views[0, values] = cfg.mask_token_id
        views[1, prompt_len:] = cfg.mask_token_id
        pred = np.asarray(predict(m.params, jnp.asarray(views)))
        right["values_masked"] += [bool(pred[0, i] == ids[i]) for i in values]
        right["answer_masked"] += [bool(pred[1, i] == ids[i]) for i in values]
        for k, i in enumerate(values):
            by_value[k].append(bool(pred[0, i] == ids[i]))
        if len(values) == 2 and pred[0, values[1]] != ids[values[1]]:
            misses[second_value_miss(ex, tok.decode([int(pred[0, values[1]])]).strip())] += 1
    engine = Engine(cfg, m.params, batch_size=16, buffer_size=1, tokenizer=tok)
    out = engine.generate([tok.encode(ex.prompt) for ex in questions], table1_decode(1))
    decoded: dict[int, list[bool]] = {1: [], 2: []}
    for ex, r in zip(questions, out):
        decoded[ex.answer.count("=")].append(ex.is_correct(r.text))

    def mean(v: list[bool]) -> float | None:
        return round(float(np.mean(v)), 3) if v else None

    return {"model": model, "questions": limit, "values": len(right["values_masked"]),
            **{k: mean(v) for k, v in right.items()},
            "values_masked_first": mean(by_value[0]), "values_masked_second": mean(by_value[1]),
            "decoded_one_key": mean(decoded[1]), "decoded_two_keys": mean(decoded[2]),
            "questions_by_keys": {k: len(v) for k, v in decoded.items()},
            "second_value_misses": {k: misses[k] for k in MISS_KINDS}}


MISS_KINDS = ("pair before", "pair after", "first key's", "other")


def second_value_miss(ex, predicted: str) -> str:
    """Whose value a wrong second value is: the pair listed just before the asked one, just
    after it, the first asked key's, or none of those (the first that fits, in that order)."""
    keys, table = re.search(r"Recall ([a-z ]+) in: ([a-z0-9= ]+)", ex.prompt).groups()
    pairs = [p.split("=") for p in table.split()]
    first, second = keys.split()
    at = [k for k, _ in pairs].index(second)
    before = pairs[at - 1][1] if at > 0 else None
    after = pairs[at + 1][1] if at + 1 < len(pairs) else None
    first_value = dict(pairs)[first]
    return ("pair before" if predicted == before else "pair after" if predicted == after else
            "first key's" if predicted == first_value else "other")


def main() -> None:
    from mbd_jax.cli import int_at_least

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated models (names or directories)")
    ap.add_argument("--limit", type=int_at_least(1), default=200, help="held-out recall questions")
    args = ap.parse_args()
    rows = [probe(m, args.limit) for m in args.models.split(",")]
    print(json.dumps(rows, indent=1))
    print("| model | values | values masked | whole answer masked | first value | second value "
          "| decoded, one key | decoded, two keys | second value misses: "
          + " / ".join(MISS_KINDS) + " |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['model']} | {r['values']} | {r['values_masked']} | {r['answer_masked']} "
              f"| {r['values_masked_first']} | {r['values_masked_second']} "
              f"| {r['decoded_one_key']} | {r['decoded_two_keys']} "
              f"| {' / '.join(str(n) for n in r['second_value_misses'].values())} |",
              file=sys.stderr)


if __name__ == "__main__":
    main()
