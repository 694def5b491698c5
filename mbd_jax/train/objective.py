"""Training objectives: block diffusion (teacher forcing) and MultiTF, one code path.

A training row is a [noisy ; clean] dual stream of length 2L; both halves carry positions 0..L-1.
The blocks of a row are partitioned into consecutive *noise groups* (a layout). Attention
(REFERENCE.md, MultiTF):

    noisy -> noisy   same group and key block <= query block
    noisy -> clean   key block < the first block of the query's group
    clean -> clean   block-causal
    clean -> noisy   never

Block diffusion is the layout where every block is its own group (G_max = 1): a noisy block sees
itself and the clean blocks before it. MultiTF trains layouts with groups of 2..G_max blocks, so a
noisy block also learns to read the still-noisy blocks before it in its group, which is what
MultiBD decoding shows it at inference.

Noise (chain-uniform): per group, a floor l ~ U(t_low, t_eff); per block in order t_i ~ U(l, t_eff),
l = t_i; then exactly int(n_maskable * t_i) random response positions of block i are masked.
Host-side sampling is NumPy (deterministic in the seed); the mask and the loss are JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.model.forward_meta import ForwardMeta, group_starts

T_LOW, T_HIGH, RHO = 0.001, 1.0, 0.01


# ----------------------------------------------------------------------------- layouts

def groups_from_sizes(sizes: list[int]) -> np.ndarray:
    """[3, 2, 1] -> [0, 0, 0, 1, 1, 2]: the group id of every block."""
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)


def _sizes(n_blocks: int, first: int, size: int) -> list[int]:
    sizes = [first] if first > 0 else []
    while sum(sizes) < n_blocks:
        sizes.append(min(size, n_blocks - sum(sizes)))
    sizes[-1] = n_blocks - sum(sizes[:-1])
    return sizes


def systematic_layouts(n_blocks: int, g_max: int) -> list[np.ndarray]:
    """Every group size g in 2..g_max with every shift 0..g-1 (the first group has `shift` blocks).
    g_max = 1 gives the block-diffusion layout (one block per group)."""
    if g_max == 1:
        return [np.arange(n_blocks, dtype=np.int32)]
    return [groups_from_sizes(_sizes(n_blocks, shift, g))
            for g in range(2, g_max + 1) for shift in range(g)]


def random_layout(n_blocks: int, g_max: int, rng: np.random.Generator) -> np.ndarray:
    """Consecutive groups with sizes drawn uniformly from 2..g_max (the last one may be shorter)."""
    sizes: list[int] = []
    while sum(sizes) < n_blocks:
        sizes.append(min(int(rng.integers(2, g_max + 1)), n_blocks - sum(sizes)))
    return groups_from_sizes(sizes)


def layouts(n_blocks: int, g_max: int, n_random: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = systematic_layouts(n_blocks, g_max)
    if g_max > 1:
        out += [random_layout(n_blocks, g_max, rng) for _ in range(n_random)]
    return out


# ----------------------------------------------------------------------------- noise

def chain_uniform_t(groups: np.ndarray, rng: np.random.Generator, t_low: float = T_LOW,
                    t_high: float = T_HIGH, rho: float = RHO) -> np.ndarray:
    """groups: [nb] -> t: [nb]; non-decreasing inside each group."""
    t_eff = t_high - rho * (t_high - t_low)
    t = np.empty(len(groups), np.float32)
    floor = None
    for b, g in enumerate(groups):
        if b == 0 or g != groups[b - 1]:
            floor = rng.uniform(t_low, t_eff)
        floor = t[b] = rng.uniform(floor, t_eff)
    return t


def mask_blocks(clean: np.ndarray, prompt_len: int, t: np.ndarray, block_size: int,
                rng: np.random.Generator) -> np.ndarray:
    """clean: [L] -> masked: [L] bool, exactly int(n_maskable * t_i) response positions of block i."""
    masked = np.zeros(len(clean), bool)
    for b, tb in enumerate(t):
        lo, hi = max(b * block_size, prompt_len), (b + 1) * block_size
        if hi <= lo:
            continue
        n = int((hi - lo) * float(tb))
        masked[lo + rng.choice(hi - lo, size=n, replace=False)] = True
    return masked


# ----------------------------------------------------------------------------- batches

@dataclasses.dataclass
class Batch:
    """One training batch (host arrays), R rows of length L."""

    noisy: np.ndarray  # [R, L] int32, clean tokens with masked positions set to mask_token_id
    clean: np.ndarray  # [R, L] int32
    masked: np.ndarray  # [R, L] bool, the positions the loss is taken on
    t: np.ndarray  # [R, L] float32, the noise level of each position's block
    groups: np.ndarray  # [R, nb] int32, the noise group of each block
    # [R, L] bool: answer positions left unmasked (the edit loss's positions: their noisy token is
    # the clean one, or a random one where edit_share corrupted it)
    filled: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)


def make_batch(rows: list[tuple[np.ndarray, int]], *, block_size: int, mask_token_id: int,
               g_max: int, n_random: int, rng: np.random.Generator, edit_share: float = 0.0,
               vocab_size: int = 0) -> Batch:
    """rows: (clean tokens [L], prompt length) per example; every example is repeated once per
    layout (block diffusion: one layout). edit_share: each unmasked answer position of the noisy
    stream becomes a random token of [0, vocab_size) with this probability (the edit mode's
    training, token to token; 0 draws nothing, so the batch is the one made without it)."""
    out: dict[str, list] = {k: [] for k in ("noisy", "clean", "masked", "t", "groups", "filled")}
    for clean, prompt_len in rows:
        n_blocks = len(clean) // block_size
        answer = np.arange(len(clean)) >= prompt_len
        for groups in layouts(n_blocks, g_max, n_random, rng):
            t = chain_uniform_t(groups, rng)
            masked = mask_blocks(clean, prompt_len, t, block_size, rng)
            filled = answer & ~masked
            noisy = clean
            if edit_share > 0:
                corrupt = filled & (rng.random(len(clean)) < edit_share)
                random = rng.integers(0, vocab_size, len(clean))
                noisy = np.where(corrupt & (random != mask_token_id), random, clean)
            out["noisy"].append(np.where(masked, mask_token_id, noisy).astype(clean.dtype))
            out["filled"].append(filled)
            out["clean"].append(clean)
            out["masked"].append(masked)
            out["t"].append(np.repeat(t, block_size))
            out["groups"].append(groups)
    return Batch(**{k: np.stack(v) for k, v in out.items()})


# ----------------------------------------------------------------------------- mask and loss

def dual_stream_mask(groups: jax.Array, block_size: int) -> jax.Array:
    """groups: [R, nb] -> visible: [R, 2L, 2L] bool over [noisy ; clean] (rules in the docstring)."""
    n_blocks = groups.shape[1]
    block = jnp.arange(n_blocks * block_size) // block_size  # [L]
    group = jnp.take(groups, block, axis=1)  # [R, L]
    first = jnp.take(group_starts(groups), block, axis=1)  # [R, L]: each position's group start
    qb, kb = block[:, None], block[None, :]  # [L, 1], [1, L]
    noisy_noisy = (group[:, :, None] == group[:, None, :]) & (kb <= qb)[None]
    noisy_clean = kb[None] < first[:, :, None]
    clean_clean = jnp.broadcast_to((kb <= qb)[None], noisy_noisy.shape)
    never = jnp.zeros_like(noisy_noisy)
    top = jnp.concatenate([noisy_noisy, noisy_clean], axis=2)
    bottom = jnp.concatenate([never, clean_clean], axis=2)
    return jnp.concatenate([top, bottom], axis=1)


def loss_fn(params, model, batch: dict[str, jax.Array], *, block_size: int,
            weighting: str = "llada2", edit: bool = False
            ) -> tuple[jax.Array, tuple[dict[str, jax.Array], Any]]:
    """Cross-entropy on masked noisy positions (label = the clean token there, no shift).

    llada2: mean over masked tokens; sdar: each token weighted 1/t of its block, self-normalised.
    edit: plus the mean cross-entropy over the filled answer positions (batch["filled"]: keep a
    right token, restore a corrupted one), what the edit sampling mode reads there.
    Returns (loss, (metrics, expert_load)): expert_load is the tree of per-layer routed-token
    counts the MoE layers sow (paths like the params', leaf `expert_load` [.., E]; empty for
    routers without a bias), for the trainer's balancing update.
    """
    noisy, clean, masked = batch["noisy"], batch["clean"], batch["masked"]
    r, seq = noisy.shape
    tokens = jnp.concatenate([noisy, clean], axis=1)  # [R, 2L]
    positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32), (r, 2))  # [R, 2L]
    mask = dual_stream_mask(batch["groups"], block_size)
    (logits, _), state = model.apply({"params": params}, tokens,
                                     ForwardMeta.explicit(positions, mask, batch["groups"]),
                                     mutable=["intermediates"])
    load = state.get("intermediates", {})
    logits = logits[:, :seq].astype(jnp.float32)  # [R, L, V]: the noisy stream's predictions
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, clean[..., None], axis=-1)[..., 0]  # [R, L]
    w = masked.astype(jnp.float32)
    if weighting == "sdar":
        w = w / batch["t"]
    loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-9)
    correct = (jnp.argmax(logits, -1) == clean) & masked
    acc = jnp.sum(correct) / jnp.maximum(jnp.sum(masked), 1)
    metrics = {"loss": loss, "token_acc": acc, "masked": jnp.sum(masked)}
    if edit:
        filled = batch["filled"]
        edit_loss = jnp.sum(nll * filled) / jnp.maximum(jnp.sum(filled), 1)
        loss = loss + edit_loss
        fixed = (jnp.argmax(logits, -1) == clean) & filled & (noisy != clean)
        metrics.update(loss=loss, edit_loss=edit_loss,
                       restored=jnp.sum(fixed) / jnp.maximum(jnp.sum(filled & (noisy != clean)), 1))
    loads = jax.tree.leaves(load)
    if loads:  # the busiest expert's load over the mean, averaged over MoE layers (1 = balanced)
        ratio = [jnp.max(x, -1) / jnp.maximum(jnp.mean(x, -1), 1e-9) for x in loads]
        metrics["max_load"] = jnp.mean(jnp.concatenate([jnp.ravel(r) for r in ratio]))
    return loss, (metrics, load)
