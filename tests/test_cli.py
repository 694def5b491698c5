"""The `mbd-jax` command as a user runs it (subprocess): output fields, profiles, clear errors."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "mbd_jax", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_generate_json_and_profile(tmp_path):
    prof = tmp_path / "trace"
    r = run("generate", "--model", "tiny-test", "--prompt", "What is 12 + 30?", "--prompt-ids", "11,12,13",
            "--max-new-tokens", "12", "--json", "--profile", str(prof), "--seed", "3")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("text", "token_ids", "nfe", "tpf", "finish_reason", "seconds", "bubble_forwards",
                    "compile_seconds"):
            assert key in row
        assert row["compile_seconds"] > 0 and row["seconds"] > 0
        assert row["finish_reason"] == "length" and len(row["token_ids"]) == 12
        assert row["nfe"] >= 1 and 0 < row["tpf"] <= 8
    assert "Traceback" not in r.stderr
    # progress while compiling, and where the trace went (after the warm-up: decoding only)
    assert "[mbd-jax] compiling the decode loop" in r.stderr and "warm-up done" in r.stderr
    assert f"profile trace written under {prof.resolve()}" in r.stderr
    assert r.stderr.index("warm-up done") < r.stderr.index("profile trace written")
    traces = list(prof.rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_a_second_run_reads_its_programs_from_the_compile_cache(tmp_path):
    """--compile-cache DIR: the first run writes every program it compiles there, the second
    reads them back (JAX's cache hits) and generates the same tokens."""
    cache = tmp_path / "xla"
    args = ("generate", "--model", "tiny-mbd", "--prompt-ids", "11,12,13", "--max-new-tokens", "8",
            "--json", "--compile-cache", str(cache))
    first, second = (json.loads(run(*args).stdout.splitlines()[0]) for _ in range(2))
    assert first["compile_cache_hits"] == 0
    assert len(list(cache.iterdir())) >= 3  # the decode loop, a prefill bucket, the merge, ...
    assert second["compile_cache_hits"] >= 3
    assert second["token_ids"] == first["token_ids"]


def test_compile_cache_setting():
    from mbd_jax import compile_cache

    assert compile_cache.resolve("off") == ""
    assert compile_cache.resolve("/x") == "/x"
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.resolve(None) == (env or compile_cache.DEFAULT_DIR)


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", ""], "empty prompt"),
    (["generate", "--prompt-ids", "11," * 1100], "max_seq_len is 256"),  # the default, tiny-mbd
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "presets: "),
    (["generate", "--prompt", "hi", "--threshold", "1.5"], "'accept_threshold' must be in [0, 1]"),
    (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["bench", "decode", "--buffer-size", "1,two"], "integers like 1,2,4"),
    (["eval", "--task", "poetry"], "unknown task(s) poetry; allowed: arith, sort, reverse, recall"),
    (["eval", "--limit", "0"], "--limit must be >= 1"),
    (["eval", "--format", "poem"], "--format: invalid choice: 'poem' (choose from 'chat', 'system'"),
    (["eval", "--buffer-size", "0"], "'buffer_size' must be in [1, 1024]"),
    (["train", "--config", "no/such.yaml"], "cannot read config file no/such.yaml"),
    (["bench", "decode", "--max-new-tokens", "5"], "--max-new-tokens is not used here"),
    (["bench", "decode", "--moe-impl", "dense,fast"], "--moe-impl 'fast': expected"),
    (["bench", "decode", "--attention-impl", "chunked,flash"], "--attention-impl 'flash': expected"),
    (["convert", "--src", "/no/such/checkpoint", "--dst", "/tmp/unused"], "no such directory"),
    (["generate", "--prompt", "hi", "--attention-chunk", "0"], "'attention_chunk' must be > 0"),
])
def test_bad_input_gives_a_clear_error(args, needle, capsys):
    """In this process (the command's `main`, what `mbd-jax` runs; a fresh interpreter per case
    cost ~5 s each): exit status 2 and the message, no exception escaping; the next test runs
    one through the installed command."""
    from mbd_jax.cli import main

    try:
        status = main(args)
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err


def test_bad_input_from_the_command_line_exits_2_with_one_line():
    r = run("generate", "--prompt-ids", "11," * 1100)
    assert r.returncode == 2, r.stderr
    assert "max_seq_len is 256" in r.stderr and "Traceback" not in r.stderr


def test_malformed_yaml_names_field_and_allowed_values(tmp_path):
    good = (ROOT / "configs/models/tiny-random.yaml").read_text()
    bad_router = tmp_path / "bad_router.yaml"
    bad_router.write_text(good.replace("router: sigmoid_grouped", "router: top2"))
    r = run("generate", "--model", str(bad_router), "--prompt", "hi")
    assert r.returncode == 2 and "field 'router' must be one of 'softmax_topk', 'sigmoid_grouped'" in r.stderr
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(good + "num_expertz: 4\n")
    r = run("generate", "--model", str(unknown), "--prompt", "hi")
    assert r.returncode == 2 and "unknown field(s) num_expertz" in r.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    r = run("generate", "--model", str(broken), "--prompt", "hi")
    assert r.returncode == 2 and "malformed YAML" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_random_weights_runs_a_shape_only_preset(tmp_path):
    """A shape-only config (init: none) refuses to load without weights, and benches with
    --random-weights."""
    shape = tmp_path / "shape.yaml"
    text = (ROOT / "configs/models/tiny-random.yaml").read_text()
    shape.write_text(text.replace("init: random", "init: none").replace(
        "tokenizer: ../tokenizers/tiny.model", ""))
    assert "init: none" in shape.read_text()
    flags = ["bench", "decode", "--model", str(shape), "--batch", "1", "--prompt-len", "8",
             "--new-tokens", "4", "--repeats", "1", "--prefill-chunk", "8", "--json"]
    refused = run(*flags)
    assert refused.returncode == 2 and "describes a shape only" in refused.stderr
    r = run(*flags, "--random-weights")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["rows"][0]["tokens_per_s"] > 0 and report["rows"][0]["compiles_after_warmup"] == 0
    assert report["rows"][0]["experts_split"] is False  # tiny-random's dense path: stacked
    assert report["rows"][0]["attention_impl"] == "chunked"  # the model's


def test_runtime_settings_override_a_checksummed_model():
    """A shipped model (manifest-checked config.yaml) decodes with another expert path given by a
    flag, without edits to its files; the paths agree token for token."""
    out = {}
    for impl in ("tiled", "dense"):  # tiny-mbd's config says tiled
        flags = () if impl == "tiled" else ("--moe-impl", impl)
        r = run("generate", "--prompt", "Sort: 7 2 9 4", "--chat", "--max-new-tokens", "16",
                "--json", *flags)
        assert r.returncode == 0, r.stderr
        out[impl] = json.loads(r.stdout.splitlines()[0])["token_ids"]
    assert out["tiled"] == out["dense"] and out["tiled"]
    status = subprocess.run(["git", "status", "--porcelain", "models/"], capture_output=True,
                            text=True, cwd=ROOT)
    assert status.stdout == ""


def test_generate_chat_uses_the_model_directorys_own_template(tmp_path):
    import shutil

    model = tmp_path / "tiny-mbd"
    shutil.copytree(ROOT / "models" / "tiny-mbd", model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:"
        "{% endif %}")
    r = run("generate", "--model", str(model), "--chat", "--prompt", "Sort: 3 1 2",
            "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    raw = run("generate", "--model", str(model), "--prompt", "Q: Sort: 3 1 2\nA:",
              "--max-new-tokens", "8", "--json")
    assert raw.returncode == 0, raw.stderr
    rows, raw_rows = ([json.loads(line) for line in out.stdout.splitlines()] for out in (r, raw))
    assert [x["token_ids"] for x in rows] == [x["token_ids"] for x in raw_rows]
    # the prompt was the directory template's, not the built-in one's
    from mbd_jax import chat
    from mbd_jax.checkpoint import load_model

    tok = load_model("tiny-mbd", with_weights=False).tokenizer
    assert rows[0]["prompt_tokens"] == len(tok.encode("Q: Sort: 3 1 2\nA:")) != len(tok.encode(
        chat.render([{"role": "user", "content": "Sort: 3 1 2"}])))


@pytest.mark.parametrize("tool, args, message", [
    ("compare_models.py", ["--models", "tiny-mbd", "--batch-size", "0"],
     "argument --batch-size: must be >= 1, got 0"),
    ("compare_models.py", ["--models", "tiny-mbd", "--buffer-size", "2,x"], "--buffer-size"),
    ("compare_models.py", ["--models", "tiny-mbd", "--threshold", "1.5"], "accept_threshold"),
    ("table1.py", ["--buffer-size", "1"], "argument --buffer-size: must be >= 2, got 1"),
    ("table1.py", ["--limit", "0"], "argument --limit: must be >= 1, got 0"),
    ("tpf_by_length.py", ["--runs", "tiny-mbd:2", "--batch-size", "two"],
     "argument --batch-size: expected an integer, got 'two'"),
])
def test_eval_tools_refuse_bad_sizes_before_loading_a_model(tool, args, message):
    """The measuring tools name a bad size or threshold and exit 2, without a traceback (a bad
    --batch-size was a UserError traceback after the model had loaded)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_without_a_config_serves_what_make_run_does():
    """`mbd-jax serve` alone (what `make run` starts) reads the shipped configs/serve.yaml: its
    settings (prefix cache on, MultiBD N_buf 2, the token limits), not the dataclass defaults."""
    from mbd_jax import cli
    from mbd_jax.config import load_serve_config

    plain = cli.serve_config(cli.build_parser().parse_args(["serve"]))
    make_run = load_serve_config(ROOT / "configs" / "serve.yaml", env=os.environ)
    assert plain == make_run
    assert plain.cache.enabled and plain.decoding.buffer_size == 2
    assert plain.generation.max_new_tokens_limit == 224


def test_an_unconverted_checkpoint_as_model_says_to_convert_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    r = run("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert r.returncode == 2 and "convert it first, e.g. mbd-jax convert --src" in r.stderr
    assert "Traceback" not in r.stderr


def test_shipped_names_resolve_from_any_working_directory(tmp_path):
    """Outside the checkout (as from an installed wheel), a shipped model verifies by name and a
    shipped training config loads by its relative path."""
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "verify", "tiny-mbd"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "tiny-mbd: verified" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-c", "from mbd_jax.train.config import load_train_config;"
                        "print(load_train_config('configs/train/tiny-mbd.yaml').steps)"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "verify", "no-such-model"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no-such-model" in r.stdout
