"""The trainer: optax AdamW, a jitted data-parallel train step, orbax checkpoints that resume exactly.

    trainer = Trainer(tcfg, model_cfg, params, tokenizer)
    trainer.restore()            # from tcfg.checkpoint_dir's latest step, if any
    trainer.fit()                # to tcfg.steps, with a progress bar and periodic checkpoints
    trainer.export()             # a model directory (config.yaml, params/, tokenizer, manifest)

The batch of step s depends only on (seed, s), so a resumed run sees exactly the batches an
uninterrupted one would. The batch rows split over the mesh's `data` axis; parameters and
optimizer state split over `expert` / `tensor` by the rules table (parallel/mesh.py) and are
replicated over `data`, and the routed experts run expert-parallel as in decoding. XLA inserts
the gradient all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import sys
import time
from typing import Any, Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mbd_jax.checkpoint import save_model, write_manifest
from mbd_jax.config import SHIPPED_MODEL_DIR, ModelConfig
from mbd_jax.errors import UserError
from mbd_jax.model import layout, moe
from mbd_jax.model.transformer import Transformer
from mbd_jax.model.sharding import param_shardings
from mbd_jax.parallel.mesh import make_mesh
from mbd_jax.tokenizer import Tokenizer
from mbd_jax.train import objective, tasks
from mbd_jax.train.config import TrainConfig

RUN_FIELDS_FILE = "train_config.json"  # in a checkpoint_dir: TrainConfig.run_fields of its run

Progress = Literal["bar", "log", "none"]  # how fit shows its steps


def encode(tokenizer: Tokenizer, ex: tasks.Example, eos: int) -> tuple[list[int], int]:
    """prompt + reply + EOS -> (token ids, prompt length)."""
    prompt = tokenizer.encode(ex.prompt)
    return prompt + tokenizer.encode(ex.reply) + [eos], len(prompt)


def example_stream(tcfg: TrainConfig, seed) -> Iterator[tasks.Example]:
    """The config's training examples (its tasks, thinking share and formats) from `seed`."""
    return tasks.examples(tcfg.tasks, seed=seed, thinking_share=tcfg.thinking_share,
                          format_weights=tcfg.format_weights,
                          raw_answer_prefix=tcfg.raw_answer_prefix)


def length_shares(tcfg: TrainConfig, cfg: ModelConfig, tokenizer: Tokenizer, n: int = 2000
                  ) -> np.ndarray:
    """[len(tcfg.lengths())] the share of examples whose shortest fitting row length is each of
    tcfg.lengths(), from a fixed sample of n (examples longer than seq_len are left out)."""
    stream = example_stream(tcfg, seed=(tcfg.seed, 2**31 - 1))
    lengths = np.array(tcfg.lengths())
    need = np.array([len(encode(tokenizer, ex, cfg.eos_token_ids[0])[0])
                     for ex, _ in zip(stream, range(n))])
    counts = np.bincount(np.searchsorted(lengths, need[need <= lengths[-1]]),
                         minlength=len(lengths))
    if counts.sum() == 0:
        raise UserError(f"seq_len {tcfg.seq_len}: no {', '.join(tcfg.tasks)} example fits; "
                        "raise seq_len")
    return counts / counts.sum()


def batch_for_step(tcfg: TrainConfig, cfg: ModelConfig, tokenizer: Tokenizer, step: int,
                   shares: np.ndarray | None = None) -> objective.Batch:
    """The training batch of `step`: a pure function of (tcfg.seed, step). The step's row
    length is drawn from tcfg.lengths() by `shares` (length_shares; None: seq_len alone, every
    example that fits), and its examples are those that need exactly that length (longer than
    the next shorter one), padded with EOS to it."""
    lengths, eos = tcfg.lengths(), cfg.eos_token_ids[0]
    pick = len(lengths) - 1
    if shares is not None and len(lengths) > 1:
        pick = int(np.random.default_rng((tcfg.seed, step, 2)).choice(len(lengths), p=shares))
    lo = lengths[pick - 1] if pick > 0 and shares is not None else 0
    hi = lengths[pick]
    # A length's examples are this share of the stream: a rare one (the longest rows) takes
    # many draws, so the give-up point scales with it (about 100x the draws it needs).
    share = float(shares[pick]) if shares is not None and len(lengths) > 1 else 1.0
    stream = example_stream(tcfg, seed=(tcfg.seed, step))
    rows: list[tuple[np.ndarray, int]] = []
    for draws, ex in enumerate(stream):
        ids, n_prompt = encode(tokenizer, ex, eos)
        if lo < len(ids) <= hi:
            rows.append((np.array(ids + [eos] * (hi - len(ids)), np.int32), n_prompt))
            if len(rows) == tcfg.batch_size:
                break
        if draws > 100 * tcfg.batch_size / share:
            raise UserError(f"seq_len {hi}: too few {', '.join(tcfg.tasks)} examples need "
                            f"{lo + 1}-{hi} tokens ({len(rows)} in {draws} draws); "
                            f"raise seq_len" + (" or drop the length bucket" if lo else ""))
    rng = np.random.default_rng((tcfg.seed, step, 1))
    return objective.make_batch(rows, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                edit_share=tcfg.edit_share, vocab_size=cfg.vocab_size,
                                g_max=tcfg.g_max, n_random=tcfg.n_random_layouts, rng=rng)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only, judged per layer: never on norms or the router's
    expert_bias, whether the layers are unrolled or scanned (a scanned run's leaves carry a
    leading layer axis, which must not make a norm look like a matrix)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim - layout.is_stacked(path) > 1, params)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.learning_rate, tcfg.warmup_steps, max(tcfg.steps, tcfg.warmup_steps + 1),
        end_value=tcfg.learning_rate * tcfg.end_lr_fraction)
    return optax.chain(optax.clip_by_global_norm(tcfg.clip_norm),
                       optax.adamw(schedule, b2=tcfg.b2, weight_decay=tcfg.weight_decay,
                                   mask=decay_mask))


def data_mesh(n: int = -1, devices: list | None = None) -> Mesh:
    """The training mesh: n devices on `data` (parallel/mesh.py's axes; expert = tensor = 1)."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices) if n == -1 else n
    if n > len(devices):
        raise UserError(f"data_parallel {n}: only {len(devices)} devices are present")
    return make_mesh({"data": n, "expert": 1, "tensor": 1}, devices)


def like_params(tree: Any, params: Any, otherwise: NamedSharding) -> Any:
    """Shardings for an optimizer-state tree: a leaf whose key path ends with a parameter's path
    (and has its shape: AdamW's mu, nu) gets that parameter's sharding, any other leaf (step
    counts) `otherwise`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    by_path = {tuple(map(str, path)): leaf for path, leaf in flat}

    def pick(path, leaf):
        keys = tuple(map(str, path))
        for i in range(len(keys)):
            match = by_path.get(keys[i:])
            if match is not None and match.shape == leaf.shape:
                return match.sharding
        return otherwise

    return jax.tree_util.tree_map_with_path(pick, tree)


def balance_experts(params: Any, expert_load: Any, rate: float) -> Any:
    """params with every router `expert_bias` moved toward balance by the loads its layer saw
    (moe.balance_bias); `expert_load` mirrors the params' paths with leaf `expert_load`."""
    if rate == 0:
        return params

    def update(path, p):
        keys = [getattr(k, "key", k) for k in path]
        if keys[-1] != "expert_bias":
            return p
        load = functools.reduce(lambda t, k: t[k], keys[:-1] + ["expert_load"], expert_load)
        return moe.balance_bias(p, load, rate)

    return jax.tree_util.tree_map_with_path(update, params)


def train_step(state: dict, batch: dict, *, model: Transformer, tx: optax.GradientTransformation,
               block_size: int, weighting: str, expert_bias_rate: float, edit: bool = False
               ) -> tuple[dict, dict]:
    loss = functools.partial(objective.loss_fn, model=model, block_size=block_size,
                             weighting=weighting, edit=edit)
    grads, (metrics, load) = jax.grad(lambda p: loss(p, batch=batch),
                                      has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    params = balance_experts(params, load, expert_bias_rate)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


class Trainer:
    def __init__(self, tcfg: TrainConfig, cfg: ModelConfig, params: Any, tokenizer: Tokenizer,
                 mesh: Mesh | None = None):
        self.tcfg = tcfg
        self.cfg = dataclasses.replace(cfg, name=tcfg.name, compute_dtype=tcfg.compute_dtype)
        self.tokenizer = tokenizer
        if tcfg.seq_len % cfg.block_size or tcfg.seq_len > cfg.max_seq_len:
            raise UserError(f"seq_len {tcfg.seq_len}: must be a multiple of block_size "
                            f"({cfg.block_size}) and <= max_seq_len ({cfg.max_seq_len})")
        odd = [n for n in tcfg.length_buckets if n % cfg.block_size]
        if odd:
            raise UserError(f"length_buckets {list(tcfg.length_buckets)}: {odd} not a multiple of "
                            f"the model's block_size ({cfg.block_size})")
        self.mesh = mesh or data_mesh(tcfg.data_parallel)
        rows = tcfg.batch_size * len(objective.layouts(tcfg.seq_len // cfg.block_size, tcfg.g_max,
                                                       tcfg.n_random_layouts,
                                                       np.random.default_rng(0)))
        if rows % self.mesh.shape["data"]:
            raise UserError(f"batch_size: {rows} rows per step do not split over "
                            f"{self.mesh.shape['data']} data-parallel devices")
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.tx = make_optimizer(tcfg)
        to_f32 = jax.jit(lambda t: jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), t),
                         out_shardings=param_shardings(self.cfg, self.mesh))  # a copy: donated
        params = to_f32(params)
        opt_shardings = like_params(jax.eval_shape(self.tx.init, params), params, self.replicated)
        self.state = {"params": params,
                      "opt_state": jax.jit(self.tx.init, out_shardings=opt_shardings)(params),
                      "step": jax.device_put(jnp.int32(0), self.replicated)}
        self.state_shardings = jax.tree.map(lambda a: a.sharding, self.state)
        self._step = jax.jit(
            functools.partial(train_step, model=Transformer(self.cfg, self.mesh), tx=self.tx,
                              block_size=cfg.block_size, weighting=tcfg.weighting,
                              expert_bias_rate=tcfg.expert_bias_rate, edit=tcfg.edit_share > 0),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        self._manager = None
        if tcfg.checkpoint_dir:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(
                tcfg.path(tcfg.checkpoint_dir).absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=tcfg.keep_checkpoints))
        self.history: list[dict[str, float]] = []  # per logged step
        self.shares = length_shares(tcfg, self.cfg, tokenizer) if tcfg.length_buckets else None
        self.example_tokens = 0  # padded example tokens trained on by this process

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def restore(self) -> bool:
        """Loads the latest checkpoint, if there is one; True when it did. A checkpoint written
        under a config that trains something else (TrainConfig.run_fields) is refused."""
        if self._manager is None or self._manager.latest_step() is None:
            return False
        import orbax.checkpoint as ocp

        self._check_run_fields()

        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                self.state)
        self.state = self._manager.restore(self._manager.latest_step(),
                                           args=ocp.args.StandardRestore(abstract))
        return True

    def save_checkpoint(self) -> None:
        import orbax.checkpoint as ocp

        if self._manager is not None:
            from mbd_jax.parallel import multihost

            record = self._run_fields_path()
            if multihost.is_leader() and not record.exists():
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps(self.tcfg.run_fields(), indent=1) + "\n")
            self._manager.save(self.step, args=ocp.args.StandardSave(self.state), force=True)

    def _run_fields_path(self) -> pathlib.Path:
        """Where a checkpoint directory records the config that wrote it."""
        return self.tcfg.path(self.tcfg.checkpoint_dir) / RUN_FIELDS_FILE

    def _check_run_fields(self) -> None:
        record = self._run_fields_path()
        if not record.exists():  # written before the record existed: nothing to compare
            return
        saved, now = json.loads(record.read_text()), self.tcfg.run_fields()
        diff = [f"{k}: {saved.get(k)!r} there, {now.get(k)!r} here"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            raise UserError(
                f"checkpoint_dir {self.tcfg.checkpoint_dir} holds a run of another config "
                f"({'; '.join(diff)}); resuming would mix the two: pass another --checkpoint-dir "
                "(or remove that one to start over)")

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the batch of the current step; returns its metrics."""
        batch = batch_for_step(self.tcfg, self.cfg, self.tokenizer, self.step, self.shares)
        self.example_tokens += self.tcfg.batch_size * batch.clean.shape[1]  # padded
        arrays = {k: jax.device_put(v, self.batch_sharding) for k, v in batch.as_dict().items()}
        self.state, metrics = self._step(self.state, arrays)
        return {k: float(v) for k, v in metrics.items()}

    def fit(self, steps: int | None = None, progress: Progress = "bar") -> list[dict[str, float]]:
        """Trains until step `steps` (default tcfg.stop_at, else tcfg.steps), checkpointing every
        checkpoint_every; `progress`: a bar, a log (one JSON line of metrics for the first step
        and every log_every steps on stderr, a line while the first step compiles), or
        nothing."""
        from tqdm import tqdm

        tcfg = self.tcfg
        end = steps if steps is not None else tcfg.stop_at or tcfg.steps
        bar = tqdm(total=end, initial=self.step, disable=progress != "bar", unit="step",
                   dynamic_ncols=True)
        t_last, tokens_last = time.perf_counter(), self.example_tokens
        first = self.step + 1
        if self.step < end:  # the first step compiles the train step: say so before it waits
            bar.set_description("compiling the train step")
            if progress == "log":
                print("[mbd-jax] compiling the train step (the first step waits for it)",
                      file=sys.stderr, flush=True)
        while self.step < end:
            metrics = self.train_step()
            bar.update(1)
            if self.step == first:
                bar.set_description("training")
            if self.step % tcfg.log_every == 0 or self.step in (first, end):
                now = time.perf_counter()
                metrics["tokens_per_s"] = (self.example_tokens - tokens_last) / (now - t_last)
                metrics["step"] = self.step
                t_last, tokens_last = now, self.example_tokens
                self.history.append(metrics)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['token_acc']:.2f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                if progress == "log":
                    print(json.dumps({k: round(v, 5) for k, v in metrics.items()}),
                          file=sys.stderr, flush=True)
            if self._manager is not None and (self.step % tcfg.checkpoint_every == 0
                                              or self.step == end):
                self.save_checkpoint()
        bar.close()
        if self._manager is not None:
            self._manager.wait_until_finished()
        return self.history

    def export(self, out_dir: str | pathlib.Path | None = None, info: dict | None = None
               ) -> pathlib.Path:
        """Writes the trained model directory (float32 parameters; float32 compute). Process 0
        writes the files; every process writes its parameter shards (call it on all)."""
        from mbd_jax.parallel import multihost

        out = self.tcfg.path(str(out_dir)) if out_dir else self.tcfg.output_dir()
        tok_name = None if not self.cfg.tokenizer else "tokenizer" + pathlib.Path(self.cfg.tokenizer).suffix
        if multihost.is_leader():
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            if tok_name:
                shutil.copy2(self.cfg.tokenizer, out / tok_name)
        multihost.barrier("export")
        cfg = dataclasses.replace(self.cfg, tokenizer=tok_name, compute_dtype="float32")
        save_model(out, cfg, self.state["params"])  # shard by shard
        if multihost.is_leader():
            write_manifest(out, {"trained_by": "mbd-jax train", "steps": self.step,
                                 "train_config": dataclasses.asdict(self.tcfg), **(info or {})})
        multihost.barrier("export done")
        return out


def run_training(tcfg: TrainConfig, progress: Progress = "bar", mesh: Mesh | None = None,
                 force: bool = False) -> pathlib.Path:
    """`mbd-jax train`: load the starting model, resume if a checkpoint exists, fit, export.
    `mesh` (default: tcfg.data_parallel devices on `data`). A shipped model directory is
    replaced only with `force` (checked before any training)."""
    from mbd_jax.checkpoint import load_model

    out = tcfg.output_dir().resolve()
    if out.exists() and out.is_relative_to(SHIPPED_MODEL_DIR.resolve()) and not force:
        raise UserError(f"output {out} is a shipped model; pass --force to replace it, or "
                        "--output another directory (default: runs/<name>-model)")

    mesh = mesh or data_mesh(tcfg.data_parallel)
    source = tcfg.path(tcfg.model)  # a run's output named from the repo root, else a name
    model = load_model(str(source) if source.exists() else tcfg.model, mesh=mesh)
    if model.tokenizer is None:
        raise UserError(f"model {tcfg.model}: training needs a tokenizer in its config")
    if model.cfg.quantization != "none":
        raise UserError(f"model {tcfg.model}: its weights are quantized ({model.cfg.quantization}); "
                        "train the float model and quantize the result")
    cfg = dataclasses.replace(model.cfg, tokenizer=str((model.path.parent / model.cfg.tokenizer)
                                                       .resolve()))
    trainer = Trainer(tcfg, cfg, model.params, model.tokenizer, mesh=mesh)
    resumed = trainer.restore()
    t0 = time.perf_counter()
    history = trainer.fit(progress=progress)
    final = history[-1] if history else {}
    return trainer.export(info={"resumed": resumed, "seconds": round(time.perf_counter() - t0, 1),
                                "final_loss": final.get("loss"),
                                "final_token_acc": final.get("token_acc")})
