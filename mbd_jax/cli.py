"""`mbd-jax` command line: generate, serve, convert, train, eval, bench decode.

User mistakes (bad flags, configs, prompts) print `error: ...` naming the field and exit 2;
they never print a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

from mbd_jax.errors import UserError
from mbd_jax.parallel import multihost

DEFAULT_MODEL = "tiny-mbd"  # trained on the task suite, shipped in models/


def _default(field: str, owner: type | None = None) -> str:
    """"default X" for a help text, read from where the setting's default lives (a decoding
    field: the service's request defaults, _decode_config; else `owner`), so it is written once."""
    if owner is not None:
        return f"default {getattr(owner, field)}"
    from mbd_jax.config import load_serve_config
    from mbd_jax.config.paths import DEFAULT_SERVE_CONFIG

    return f"default {load_serve_config(DEFAULT_SERVE_CONFIG).decode_defaults()[field]}"


def _add_decode_flags(p: argparse.ArgumentParser, buffer_size_list: bool = False) -> None:
    import typing

    from mbd_jax.config import (BlockActivation, EditConfirm, SamplingMode, UnmaskPolicy,
                                VoteExtractor, VoteWeighting, VotingConfig)

    g = p.add_argument_group("decoding (see DecodeConfig)")
    g.add_argument("--max-new-tokens", type=int, help=f"tokens to generate at most ({_default('max_new_tokens')})")
    g.add_argument("--threshold", "--accept-threshold", dest="accept_threshold", type=float,
                   help="tau_accept: accept masked positions above this confidence "
                        f"({_default('accept_threshold')})")
    if buffer_size_list:  # benches compare several sizes on the same prompts
        g.add_argument("--buffer-size", dest="buffer_size_list", default="1",
                       help="comma-separated N_buf values to compare, e.g. 1,2,4")
        p.set_defaults(buffer_size=None)
    else:
        g.add_argument("--buffer-size", type=int, help="N_buf, blocks decoded at once (1 = "
                       f"SingleBD; {_default('buffer_size')})")
    g.add_argument("--add-block-threshold", type=float, help=f"tau_add ({_default('add_block_threshold')})")
    g.add_argument("--block-activation", choices=typing.get_args(BlockActivation),
                   help="progress: the next block joins once the last is tau_add full, one per "
                        "forward; eager: every slot of the buffer at once "
                        f"({_default('block_activation')})")
    g.add_argument("--semi-complete-threshold", type=float, help=f"tau_semi ({_default('semi_complete_threshold')})")
    g.add_argument("--token-stability-threshold", type=float, help=f"tau_stable ({_default('token_stability_threshold')})")
    g.add_argument("--policy", choices=typing.get_args(UnmaskPolicy), help="unmask rule")
    g.add_argument("--steps-per-block", type=int, help="fixed_steps: steps per block")
    g.add_argument("--factor", type=float, help=f"factor policy (Fast-dLLM): f ({_default('factor')})")
    g.add_argument("--sampling-mode", choices=typing.get_args(SamplingMode),
                   help="edit: also rewrite filled tokens the model changes its mind on")
    g.add_argument("--edit-threshold", type=float, help="edit: rewrite above this confidence")
    g.add_argument("--max-post-edit-steps", type=int, help="edit: extra steps before a block is final")
    g.add_argument("--edit-confirm", choices=typing.get_args(EditConfirm),
                   help="edit: which blocks wait for a forward that changes nothing in them: "
                        "always, or only those written before the blocks ahead were complete "
                        f"(context) ({_default('edit_confirm')})")
    g.add_argument("--vote", choices=typing.get_args(VoteWeighting),
                   help="temporal self-consistency voting with this step weighting")
    g.add_argument("--vote-alpha", type=float,
                   help=f"exp weighting alpha ({_default('alpha', VotingConfig)})")
    g.add_argument("--vote-extractor", choices=typing.get_args(VoteExtractor),
                   help=f"how an answer is parsed ({_default('extractor', VotingConfig)})")
    g.add_argument("--vote-pattern", help="regex extractor: answer = group 1")
    g.add_argument("--temperature", type=float, help=f"0 = greedy ({_default('temperature')})")
    g.add_argument("--top-p", type=float, help=f"nucleus sampling mass ({_default('top_p')})")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens (0: no limit; "
                                             f"{_default('top_k')})")
    g.add_argument("--seed", type=int, help=f"sampling seed ({_default('seed')})")
    g.add_argument("--max-nfe", type=int,
                   help=f"decode forwards per request at most ({_default('max_nfe')})")
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode all --max-new-tokens past EOS (fixed work per row)")


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """Runtime settings of the model (config.RuntimeConfig): override the model's config.yaml
    without editing it (its checksum covers it)."""
    import typing

    from mbd_jax.config import (AUTO, MEASURED, AttentionImpl, DType, LayerLoop, MoeImpl,
                                Quantization)

    def auto(field: str) -> str:
        table = AUTO[field]
        if "cpu" not in table:
            return f"auto = {table['*']}"
        text = f"auto = {table['cpu']} on CPU, {table['*']} elsewhere"
        if field in MEASURED:
            cpu, other = MEASURED[field]["cpu"], MEASURED[field]["*"]
            text += (f"; measure = the faster of {'/'.join(cpu)} on CPU ({'/'.join(other)} "
                     "elsewhere) per decode program, timed at warm-up")
        return text

    g = p.add_argument_group("runtime settings (default: the model's config)")
    g.add_argument("--moe-impl", choices=typing.get_args(MoeImpl), help="expert path; " + auto("moe_impl"))
    g.add_argument("--attention-impl", choices=typing.get_args(AttentionImpl))
    g.add_argument("--attention-chunk", type=int, help="keys per online-softmax chunk")
    g.add_argument("--layer-loop", choices=typing.get_args(LayerLoop),
                   help="scan: one compiled layer per run of identical layers; " + auto("layer_loop"))
    g.add_argument("--compute-dtype", choices=typing.get_args(DType))
    g.add_argument("--quantize", dest="quantization", choices=typing.get_args(Quantization),
                   help="quantize a float model's weight matrices as it loads (8 bits, a scale "
                        "per output channel)")
    g.add_argument("--kv-quantize", dest="kv_quantization", choices=typing.get_args(Quantization),
                   help="the KV pool in 8 bits, a scale per position and kv head (default: the "
                        "compute dtype)")
    g.add_argument("--max-model-len", dest="max_seq_len", type=int,
                   help="context length to serve (at most the model's; a smaller KV buffer; a "
                        "multiple of the block size)")


def _add_compile_cache_flag(p: argparse.ArgumentParser, default: str | None = None) -> None:
    from mbd_jax.compile_cache import DEFAULT_DIR, OFF

    p.add_argument("--compile-cache", metavar="DIR", default=default,
                   help=f"keep compiled programs in DIR across runs ({OFF}: none; default: "
                        + (f"{OFF}, so compile times are cold" if default == OFF else
                           f"$JAX_COMPILATION_CACHE_DIR, else {DEFAULT_DIR}") + ")")


def _runtime(args: argparse.Namespace) -> dict:
    from mbd_jax.config import RUNTIME_FIELDS

    return {f: getattr(args, f, None) for f in RUNTIME_FIELDS}


def _decode_config(args: argparse.Namespace):
    """The decoding flags given, over the service's request defaults for this model (the
    shipped configs/serve.yaml as `mbd-jax serve` reads it: its decoding section over the model
    directory's generation.yaml over DecodeConfig's defaults; ServeConfig.decode_defaults)."""
    from mbd_jax.config import decode_config, load_serve_config
    from mbd_jax.config.paths import DEFAULT_SERVE_CONFIG

    voting = None
    if args.vote:
        voting = {k: v for k, v in (("weighting", args.vote), ("alpha", args.vote_alpha),
                                    ("extractor", args.vote_extractor),
                                    ("pattern", args.vote_pattern)) if v is not None}
    flags = dict(
        policy=args.policy, factor=args.factor, sampling_mode=args.sampling_mode,
        edit_threshold=args.edit_threshold, max_post_edit_steps=args.max_post_edit_steps,
        edit_confirm=args.edit_confirm, block_activation=args.block_activation,
        voting=voting,
        buffer_size=args.buffer_size, accept_threshold=args.accept_threshold,
        add_block_threshold=args.add_block_threshold,
        semi_complete_threshold=args.semi_complete_threshold,
        token_stability_threshold=args.token_stability_threshold,
        steps_per_block=args.steps_per_block, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens, max_nfe=args.max_nfe,
        ignore_eos=args.ignore_eos or None)
    service = load_serve_config(DEFAULT_SERVE_CONFIG, model=getattr(args, "model", None))
    return decode_config(**{**service.decode_defaults(),
                            **{k: v for k, v in flags.items() if v is not None}})


def _progress(message: str) -> None:
    """Progress of slow steps (compiling, benchmarks), on stderr so stdout stays data."""
    print(f"[mbd-jax] {message}", file=sys.stderr, flush=True)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from mbd_jax import canvas_model
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.profiling import maybe_trace

    if canvas_model.is_canvas_model(args.model):
        return _generate_canvases(args)
    decode = _decode_config(args)
    prompts_text = list(args.prompt or [])
    prompts_ids = [_parse_ids(t) for t in (args.prompt_ids or [])]
    if not prompts_text and not prompts_ids:
        raise UserError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if any(t == "" for t in prompts_text):
        raise UserError("--prompt: empty prompt; give some text")
    if args.thinking and not args.chat:
        raise UserError("--thinking switches the chat template's thinking section on: add --chat")
    mesh = multihost.mesh_from_args(args)
    model = load_model(args.model, mesh=mesh, runtime=_runtime(args))
    if prompts_text and model.tokenizer is None:
        raise UserError(f"--model {args.model} has no tokenizer; use --prompt-ids")
    if args.chat:  # each prompt is one user turn in the model's chat template
        from mbd_jax import chat

        template = chat.for_model(model.path.parent, model.cfg.chat_template)
        prompts_text = [template.render([{"role": "user", "content": t}], thinking=args.thinking)
                        for t in prompts_text]
    prompts = [model.tokenizer.encode(t) for t in prompts_text] + prompts_ids
    record = (0, 0)
    if decode.voting is not None:  # record every step's prediction of the generated region
        from mbd_jax.decoding.voting import record_shape

        record = record_shape(decode.max_nfe, decode.max_new_tokens, model.cfg.max_seq_len)
    engine = Engine(model.cfg, model.params, batch_size=args.batch_size or min(len(prompts), 8),
                    buffer_size=decode.buffer_size, tokenizer=model.tokenizer,
                    record_steps=record[0], record_len=record[1], mesh=mesh)
    for i, p in enumerate(prompts):  # fail before compiling anything
        engine.check_prompt(p, where=f"prompt[{i}]")
    from mbd_jax import compile_stats

    t0, hits0 = time.perf_counter(), compile_stats.cache_hits()
    # compile what these prompts run first: `seconds` is decoding alone
    engine.warmup(progress=_progress, buckets=engine.prefill_buckets_for(prompts))
    compile_seconds = time.perf_counter() - t0
    warm = {"compile_seconds": round(compile_seconds, 3),  # programs read from --compile-cache:
            "compile_cache_hits": compile_stats.cache_hits() - hits0}
    with maybe_trace(args.profile):
        results = engine.generate(prompts, decode)
    if not multihost.is_leader():  # process 0 prints
        return 0
    for r in results:
        if args.json:  # seconds: prefill + decode of its batch; compile_seconds: the warm-up
            print(json.dumps({**r.to_json(), **warm}))
        else:
            print(r.text if r.text is not None else r.token_ids)
            print(f"[{r.finish_reason}] tokens={len(r.token_ids)} nfe={r.nfe} tpf={r.tpf:.2f} "
                  f"bubbles={r.bubble_forwards} seconds={r.seconds:.3f}", file=sys.stderr)
            if decode.voting is not None:
                print(f"voted answer: {r.voted_answer} (final text's: {r.final_answer})",
                      file=sys.stderr)
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from mbd_jax.bench import bench_decode, format_table
    from mbd_jax.checkpoint import load_model

    decode = _decode_config(args)
    try:
        sizes = [int(s) for s in str(args.buffer_size_list).split(",")]
    except ValueError:
        raise UserError(f"--buffer-size {args.buffer_size_list!r}: expected integers like 1,2,4") from None
    if args.max_new_tokens is not None:
        raise UserError("bench decode generates exactly --new-tokens per row; --max-new-tokens is "
                        "not used here")
    import typing

    from mbd_jax.config import AttentionImpl, LayerLoop, MoeImpl

    def choices(flag: str, value: str | None, allowed: tuple[str, ...]) -> list[str] | None:
        items = value.split(",") if value else None
        for item in items or []:
            if item not in allowed:
                raise UserError(f"{flag} {item!r}: expected a comma-separated list of "
                                f"{', '.join(allowed)}")
        return items

    impls = choices("--moe-impl", args.moe_impl, typing.get_args(MoeImpl))
    loops = choices("--layer-loop", args.layer_loop, typing.get_args(LayerLoop))
    attention = choices("--attention-impl", args.attention_impl, typing.get_args(AttentionImpl))
    mesh = multihost.mesh_from_args(args)
    model = load_model(args.model, random_weights=args.random_weights, mesh=mesh)
    report = bench_decode(model.cfg, model.params, batch=args.batch, prompt_len=args.prompt_len,
                          new_tokens=args.new_tokens, buffer_sizes=sizes, decode=decode,
                          repeats=args.repeats, moe_impls=impls, layer_loops=loops,
                          attention_impls=attention, mesh=mesh,
                          prefill_chunk=args.prefill_chunk,
                          progress=_progress if multihost.is_leader() else None)
    if not multihost.is_leader():
        return 0
    print(format_table(report), file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    return 0


def serve_config(args: argparse.Namespace):
    """The service's settings: --config (default: the shipped configs/serve.yaml, as `make run`),
    then MBD_* variables, then the flags given."""
    from mbd_jax.config import load_serve_config
    from mbd_jax.config.paths import DEFAULT_SERVE_CONFIG

    return load_serve_config(args.config or DEFAULT_SERVE_CONFIG, env=os.environ, **{
        "model": args.model, "server.host": args.host, "server.port": args.port,
        "server.admin_host": args.admin_host, "server.admin_port": args.admin_port,
        "server.max_batch_size": args.max_batch_size,
        "server.served_model_name": args.served_model_name,
        "server.compile_cache": args.compile_cache,
        "server.ssl_certfile": args.ssl_certfile, "server.ssl_keyfile": args.ssl_keyfile,
        **{f"runtime.{k}": v for k, v in _runtime(args).items()}})


def _generate_canvases(args: argparse.Namespace) -> int:
    """`mbd-jax generate` on a uniform-noise (DiffusionGemma) model: the canvas engine
    (engine/canvas_engine.py), its settings the model's generation.yaml under the flags."""
    from mbd_jax import canvas_model
    from mbd_jax.config import from_dict
    from mbd_jax.config.diffusion_gemma import CanvasDecoding
    from mbd_jax.engine.canvas_engine import CanvasEngine

    if args.chat or args.thinking:
        raise UserError("--chat: give the rendered prompt as --prompt (the service renders "
                        "chats with the model's template)")
    model = canvas_model.load(args.model, quantization=getattr(args, "quantization", None))
    flags = {"noise": args.noise, "steps": args.denoising_steps,
             "entropy_bound": args.entropy_bound, "t_min": args.t_min, "t_max": args.t_max,
             "seed": args.seed, "max_new_tokens": args.max_new_tokens,
             "buffer_size": args.buffer_size}
    decoding = from_dict(CanvasDecoding, {**dataclasses.asdict(model.decoding),
                                          **{k: v for k, v in flags.items() if v is not None}},
                         where="decoding")
    decoding.validate("decoding")
    if args.prompt and model.tokenizer is None:
        raise UserError(f"--model {args.model} has no tokenizer; use --prompt-ids")
    prompts = [model.tokenizer.encode(t) for t in args.prompt or []]
    prompts += [_parse_ids(t) for t in args.prompt_ids or []]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("give at least one non-empty --prompt TEXT or --prompt-ids 1,2,3")
    c = model.cfg.canvas_length
    longest = max(map(len, prompts)) + -(-decoding.max_new_tokens // c) * c
    engine = CanvasEngine(model.cfg, model.params, batch_size=min(len(prompts), 8),
                          max_len=min(longest, model.cfg.max_seq_len), tokenizer=model.tokenizer,
                          defaults=decoding)
    t0 = time.perf_counter()
    results = engine.generate(prompts, decoding)
    seconds = time.perf_counter() - t0  # compiling included
    for r in results:
        if args.json:
            print(json.dumps({"text": r.text, "token_ids": r.token_ids, "eos": r.eos,
                              "finish_reason": r.finish_reason, "decoder_passes": r.nfe,
                              "canvases": r.blocks, "seconds": round(seconds, 3)}))
        else:
            print(r.text if r.text is not None else r.token_ids)
            print(f"[{r.finish_reason}] canvases={r.blocks} decoder_passes={r.nfe} "
                  f"tpf={r.tpf:.2f}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mbd_jax.serving.server import load_api_keys, serve

    cfg = serve_config(args)
    keys = load_api_keys(args.api_key_file, args.api_key or [])
    return serve(cfg, keys, mesh=multihost.mesh_from_args(args))


def cmd_convert(args: argparse.Namespace) -> int:
    from mbd_jax.convert import convert

    from mbd_jax.quantized_copy import is_model_dir, quantized_copy

    if is_model_dir(pathlib.Path(args.src)):
        if args.quantize == "none":
            raise UserError(f"--src {args.src}: is an mbd-jax model directory already; give "
                            "--quantize to write a quantized copy of it")
        manifest = quantized_copy(args.src, args.dst, args.quantize)
    else:
        manifest = convert(args.src, args.dst, family=args.family, dtype=args.dtype,
                           mask_token_id=args.mask_token_id, block_size=args.block_size,
                           block_mode=args.block_mode, quantization=args.quantize)
    print(json.dumps({k: v for k, v in manifest.items() if k != "files"}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every check passes, 1 naming each failure (2: bad usage)."""
    from mbd_jax import canvas_model
    from mbd_jax.checkpoint import verify_model_dir

    from mbd_jax.config.paths import shipped

    path = shipped(args.model_dir)
    results = (canvas_model.verify(path) if canvas_model.is_canvas_model(str(path))
               else verify_model_dir(path))
    failed = [(check, problem) for check, problem in results if problem]
    if args.json:
        print(json.dumps({"model_dir": args.model_dir, "ok": not failed,
                          "checks": [{"check": c, "problem": p} for c, p in results]}))
    else:
        for check, problem in results:
            print(f"{'FAIL' if problem else 'ok':>4}  {check}" + (f": {problem}" if problem else ""))
        print(f"{args.model_dir}: " + (f"{len(failed)} problem(s)" if failed else "verified"))
    return 1 if failed else 0


def cmd_train(args: argparse.Namespace) -> int:
    from mbd_jax.train.config import load_train_config, parse_overrides
    from mbd_jax.train.trainer import run_training

    # a path given on the command line is the working directory's (the config's own relative
    # paths are the repository's: TrainConfig.path)
    paths = {k: str(pathlib.Path(v).absolute()) for k, v in (
        ("checkpoint_dir", args.checkpoint_dir), ("output", args.output)) if v is not None}
    overrides = {**parse_overrides(args.set or []), **paths,
                 **({"steps": args.steps} if args.steps is not None else {})}
    tcfg = load_train_config(args.config, **overrides)
    import jax

    mesh = multihost.mesh_from_args(args) if args.mesh or jax.process_count() > 1 else None
    progress = "none" if not multihost.is_leader() else "log" if args.no_progress else "bar"
    out = run_training(tcfg, progress=progress, mesh=mesh, force=args.force)
    if multihost.is_leader():
        print(json.dumps({"model_dir": str(out)}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from mbd_jax import eval_data
    from mbd_jax.checkpoint import load_model
    from mbd_jax.evaluate import evaluate, evaluate_dataset, task_names

    decode = _decode_config(args)
    if args.dataset and args.task is not None:
        raise UserError("give --task (built-in splits) or --dataset (your files), not both")
    for path in args.dataset or []:  # fail before loading anything
        eval_data.load(path)
    if args.dataset:
        eval_data.scorer(args.scorer)
    else:
        task_names(args.task or "all", args.limit)
    mesh = multihost.mesh_from_args(args)
    model = load_model(args.model, mesh=mesh, runtime=_runtime(args))
    progress = not args.no_progress and multihost.is_leader()
    if args.dataset:
        reports = [evaluate_dataset(model, path, decode, args.scorer, batch_size=args.batch_size,
                                    progress=progress, mesh=mesh) for path in args.dataset]
    else:
        reports = [evaluate(model, args.task or "all", decode, limit=args.limit,
                            batch_size=args.batch_size, progress=progress, mesh=mesh,
                            fmt=args.format)]
    if not multihost.is_leader():
        return 0
    for report in reports:
        if args.json:
            print(json.dumps(report.to_json()))
        else:
            print(f"{report.model} {report.task} ({report.format}) n={report.n} "
                  f"accuracy={report.accuracy:.3f} "
                  f"tpf={report.tpf:.2f} tokens/s={report.tokens_per_s:.1f}")
    return 0


def add_convert_args(c: argparse.ArgumentParser) -> None:
    import typing

    from mbd_jax.config import BlockMode, Quantization
    from mbd_jax.convert import FAMILIES

    c.add_argument("--src", required=True, help="Hugging Face checkpoint directory (or an "
                                                 "mbd-jax model directory, with --quantize)")
    c.add_argument("--dst", required=True, help="output model directory")
    c.add_argument("--family", default="auto", choices=["auto", *FAMILIES],
                   help="model family (default: auto, from config.json)")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameter dtype (default: bfloat16), also written as the compute dtype "
                        "(override at load with --compute-dtype)")
    c.add_argument("--quantize", choices=typing.get_args(Quantization), default="none",
                   help="store the weight matrices in 8 bits with a scale per output channel "
                        "(int8, or fp8 e4m3; embeddings, norms and routers stay in --dtype)")
    c.add_argument("--mask-token-id", type=int,
                   help="the mask token (default: from config.json or the tokenizer)")
    c.add_argument("--block-size", type=int,
                   help="the model's diffusion block size (default: config.json's block_size / "
                        "block_length; required when it states none)")
    c.add_argument("--block-mode", choices=typing.get_args(BlockMode),
                   help="how a hybrid model's linear-attention layers read inside a block "
                        "(default: config.json's block_mode; required for a hybrid when it states "
                        "none; docs/architecture.md)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd-jax", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_generate_command, _serve_command, _convert_and_verify_commands, _train_command,
                _eval_command, _bench_command, _plan_command):
        add(sub)
    return ap


def _generate_command(sub) -> None:
    """`mbd-jax generate`: prompts in, completions out."""
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", default=DEFAULT_MODEL, help="preset name, YAML file or model dir")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompt-ids", action="append", help="prompt token ids, e.g. 1,2,3 (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="render each --prompt as a user turn in the model's chat template")
    g.add_argument("--thinking", action="store_true",
                   help="with --chat: thinking on (the reply is the reasoning, </think>, the answer)")
    g.add_argument("--batch-size", type=int, help="rows decoded together (default: #prompts, <= 8)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.add_argument("--profile", metavar="DIR", help="write a JAX profiler trace to DIR")
    _add_decode_flags(g)
    c = g.add_argument_group("canvas decoding (uniform-noise models: DiffusionGemma; "
                             "--max-new-tokens, --seed and --buffer-size 1|2 apply too)")
    c.add_argument("--noise", choices=("uniform", "deterministic"),
                   help="uniform: seeded random canvases; deterministic: the cross-framework "
                        "contract (decoding/canvas.py)")
    c.add_argument("--denoising-steps", type=int, help="decoder passes per canvas at most")
    c.add_argument("--entropy-bound", type=float, help="accept low-entropy positions up to this "
                                                       "summed entropy")
    c.add_argument("--t-min", type=float, help="temperature at the last step")
    c.add_argument("--t-max", type=float, help="temperature at the first step")
    _add_runtime_flags(g)
    _add_compile_cache_flag(g)
    multihost.add_launch_flags(g)
    g.set_defaults(func=cmd_generate)


def _serve_command(sub) -> None:
    """`mbd-jax serve`: the HTTP service."""
    s = sub.add_parser("serve", help="the HTTP service (OpenAI-compatible; admin port for metrics)",
                       epilog="Every serve config field can also be set in the environment: "
                              "MBD_<SECTION>_<FIELD>, e.g. MBD_SERVER_PORT=8001 (the command line "
                              "wins over the environment, which wins over the file).")
    s.add_argument("--model", help="preset, YAML or model dir (default: the config's, tiny-mbd)")
    s.add_argument("--config", help="serve config YAML (default: the shipped configs/serve.yaml, "
                                    "what `make run` serves with)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--admin-host")
    s.add_argument("--admin-port", type=int, help="metrics and profiling (0: none; /metrics then "
                                                  "on --port)")
    s.add_argument("--api-key", action="append", help="an accepted API key (repeatable)")
    s.add_argument("--api-key-file", help="one API key per line (also: MBD_API_KEYS=k1,k2)")
    s.add_argument("--max-batch-size", type=int, help="rows decoded together")
    s.add_argument("--ssl-certfile", help="HTTPS on --port: the certificate chain (PEM)")
    s.add_argument("--ssl-keyfile", help="HTTPS on --port: the private key (PEM)")
    s.add_argument("--served-model-name", help="the model id clients use (default: the model's "
                                                "name)")
    _add_runtime_flags(s)
    _add_compile_cache_flag(s)
    multihost.add_launch_flags(s)
    s.set_defaults(func=cmd_serve)


def _convert_and_verify_commands(sub) -> None:
    """`mbd-jax convert` (a Hugging Face checkpoint to a model directory) and `verify`."""
    c = sub.add_parser("convert", help="convert a Hugging Face / PyTorch checkpoint")
    add_convert_args(c)
    c.set_defaults(func=cmd_convert)

    v = sub.add_parser("verify", help="check a model directory (config, checksums, parameter "
                                      "shapes, tokenizer) without serving it; exit 1 on a problem")
    v.add_argument("model_dir")
    v.add_argument("--json", action="store_true", help="one JSON object")
    v.set_defaults(func=cmd_verify)


def _train_command(sub) -> None:
    """`mbd-jax train`: block diffusion or MultiTF training from a config."""
    t = sub.add_parser("train", help="train or post-train a model (block diffusion / MultiTF)")
    t.add_argument("--config", required=True, help="a training config, e.g. configs/train/tiny-bd.yaml")
    t.add_argument("--steps", type=int, help="override the config's steps")
    t.add_argument("--checkpoint-dir", help="override the config's checkpoint_dir (resumes from "
                                            "it; relative to the working directory)")
    t.add_argument("--output", help="the model directory to write, relative to the working "
                                    "directory (default: the config's output, else "
                                    "runs/<name>-model, relative to the repository)")
    t.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override one config field (repeatable; VALUE as YAML), e.g. --set g_max=3")
    t.add_argument("--force", action="store_true", help="allow replacing a shipped model (models/)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar: a JSON line of metrics every log_every steps (stderr)")
    multihost.add_launch_flags(t)
    t.set_defaults(func=cmd_train)


def _eval_command(sub) -> None:
    """`mbd-jax eval`: accuracy, TPF and tokens/s on held-out task splits."""
    e = sub.add_parser("eval", help="exact-match accuracy, TPF and tokens/s on a held-out task split")
    e.add_argument("--model", default=DEFAULT_MODEL, help="preset name, YAML file or model dir")
    from mbd_jax.train import tasks

    e.add_argument("--task", default=None,
                   help=f"{tasks.EVAL_TASKS_HELP} (default: all, unless --dataset is given)")
    e.add_argument("--dataset", action="append", metavar="FILE.jsonl",
                   help="your own examples instead of a task: one JSON object a line with "
                        "'prompt' (text) or 'messages' (a chat) and 'answer' (repeatable: a "
                        "report per file; mbd_jax/eval_data.py)")
    e.add_argument("--scorer", default="exact",
                   help="how a --dataset reply is judged: exact, regex (the answer is a pattern "
                        "to find), number (the last number equals the answer) or "
                        "module:function(reply, answer) -> bool (default: exact)")
    e.add_argument("--format", default="chat", choices=tasks.FORMATS,
                   help="how each question reaches the model: a chat turn, after a system line, "
                        "after an earlier turn, or raw text with no template (default: chat)")
    e.add_argument("--limit", type=int, default=100, help="held-out examples per task")
    e.add_argument("--batch-size", type=int, default=16, help="rows decoded together")
    e.add_argument("--json", action="store_true", help="one JSON object")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_decode_flags(e)
    _add_runtime_flags(e)
    _add_compile_cache_flag(e)
    multihost.add_launch_flags(e)
    e.set_defaults(func=cmd_eval)


def _bench_command(sub) -> None:
    """`mbd-jax bench decode`: decode throughput per buffer size."""
    from mbd_jax.config import ServerConfig

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    d = bsub.add_parser("decode", help="decode throughput, TPF and step latency per buffer size")
    d.add_argument("--model", default=DEFAULT_MODEL)
    d.add_argument("--random-weights", action="store_true",
                   help="random weights for a shape-only preset (e.g. llada2-mini on a GPU)")
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--prefill-chunk", type=int, default=ServerConfig.prefill_chunk,
                   help="longest prefill program; warm-up compiles every bucket up to it "
                        "(default: the service's, %(default)s)")
    d.add_argument("--moe-impl", help="expert paths to compare, e.g. dense,tiled,auto (default: "
                                      "the model's)")
    d.add_argument("--layer-loop", help="layer loops to compare, e.g. unrolled,scan (default: the "
                                        "model's)")
    d.add_argument("--attention-impl", help="attention paths to compare, e.g. chunked,pallas "
                                            "(default: the model's)")
    d.add_argument("--json", action="store_true")
    _add_decode_flags(d, buffer_size_list=True)
    _add_compile_cache_flag(d, default="off")
    multihost.add_launch_flags(d)
    d.set_defaults(func=cmd_bench_decode)


def cmd_plan(args: argparse.Namespace) -> int:
    """Compiles the engine for the target and prints what it holds and how fast it should step;
    exit 1 when a program does not fit within the budget."""
    from mbd_jax import plan

    plan.jax_for_planning()  # before any backend starts: the devices are compile-only
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import deviceless

    if not 0 < args.budget <= 1:
        raise UserError(f"--budget {args.budget}: expected a share of HBM in (0, 1]")
    from mbd_jax import canvas_model

    if canvas_model.is_canvas_model(args.model):
        return _plan_canvases(args)
    cfg = load_model(args.model, with_weights=False, runtime=_runtime(args)).cfg
    shape = deviceless.EngineShape(args.batch, args.buffer_size, args.prefill_chunk,
                                   args.kv_pool_tokens)
    report = plan.plan(cfg, args.target, args.hosts, args.devices_per_host, args.mesh, shape,
                       context=args.context, budget=args.budget, say=_progress)
    print(json.dumps(report) if args.json else plan.table(report))
    return 0 if report["fits"] else 1


def _plan_canvases(args: argparse.Namespace) -> int:
    """`mbd-jax plan` on a canvas model (canvas_plan.py): --context is the positions a row
    holds (default 32768), --denoising-steps the passes per canvas (default 16)."""
    from mbd_jax import canvas_model, canvas_plan

    if args.hosts != 1:
        raise UserError("--hosts: a canvas model is planned on one host's devices")
    cfg = canvas_model.load(args.model, with_weights=False).cfg
    shape = canvas_plan.CanvasShape(args.batch, args.context or 32768, min(args.buffer_size, 2),
                                    args.prefill_chunk, args.quantization or "none")
    report = canvas_plan.plan(cfg, args.target, args.devices_per_host, args.mesh, shape,
                              steps=args.denoising_steps or 16, budget=args.budget, say=_progress)
    print(json.dumps(report) if args.json else canvas_plan.table(report))
    return 0 if report["fits"] else 1


def _plan_command(sub) -> None:
    """`mbd-jax plan`: memory and a modelled step time on GPUs that are not here."""
    from mbd_jax.arguments import int_at_least
    from mbd_jax.config import ServerConfig
    from mbd_jax.engine.deviceless import TARGETS

    p = sub.add_parser("plan", help="does a model fit, and how fast should it step, on given GPUs "
                                    "(compiled for them here, no GPU needed)",
                       epilog="Needs the gpu-compile extra: pip install -e '.[gpu-compile]'.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, YAML file or model dir")
    p.add_argument("--target", default="h200",
                   help=f"{', '.join(TARGETS)}, or a GpuTargetConfigProto text file (default h200)")
    p.add_argument("--hosts", type=int_at_least(1), default=1)
    p.add_argument("--devices-per-host", type=int_at_least(1), default=8)
    p.add_argument("--mesh", default="", help="e.g. expert=8 or expert=4,tensor=2 (default: "
                                             "tensor over every device)")
    p.add_argument("--batch", type=int_at_least(1), default=ServerConfig.max_batch_size,
                   help="rows decoded together (default: the service's, %(default)s)")
    p.add_argument("--buffer-size", type=int_at_least(1), default=ServerConfig.buffer_size)
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=ServerConfig.prefill_chunk)
    p.add_argument("--kv-pool-tokens", type=int_at_least(1),
                   help="KV pool positions over all rows (default: every row a full context)")
    p.add_argument("--context", type=int_at_least(1),
                   help="visible positions a decode step reads (default: max_seq_len)")
    p.add_argument("--budget", type=float, default=0.9, help="share of HBM a program may use")
    p.add_argument("--denoising-steps", type=int_at_least(1),
                   help="a canvas model's decoder passes per canvas in the modelled time "
                        "(default 16)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    _add_runtime_flags(p)
    p.set_defaults(func=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        multihost.initialize(args)  # before any JAX computation; nothing for one process
        if args.func is not cmd_serve and hasattr(args, "compile_cache"):  # serve: its config's
            from mbd_jax import compile_cache

            compile_cache.enable(args.compile_cache)  # before the first compilation
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
