# The README's commands. Each sets up what it needs on a fresh machine (Python 3.11+).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= Sort: 7 2 9 4
PORT   ?= 8000
ADMIN_PORT ?=

.PHONY: run generate test test-slow lint bench models clean promtool

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed

# The CUDA plugin (the gpu-compile extra) in its own directory, outside the environment's import
# path: the GPU compile check runs in a process that puts it on PYTHONPATH with JAX_PLATFORMS=cpu,
# and every other process keeps a plain CPU JAX (tests/test_gpu_compile.py).
$(VENV)/gpu-compile/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade --no-deps --target $(VENV)/gpu-compile $$($(BIN)/python -c \
	  "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu-compile']))")
	touch $@

## make run: install and start the HTTP service on the embedded default model (Ctrl-C stops it);
## PORT=... and ADMIN_PORT=... (default 9100; 0: none) move it; MBD_<SECTION>_<FIELD>=... sets any setting
run: $(VENV)/.installed
	$(BIN)/mbd-jax serve --port $(PORT) $(if $(ADMIN_PORT),--admin-port $(ADMIN_PORT))

## make generate: one offline generation (a chat turn) on the default model
generate: $(VENV)/.installed
	$(BIN)/mbd-jax generate --chat --prompt "$(PROMPT)" --max-new-tokens 32 --buffer-size 2

## make test: install with the dev extras (and promtool, where apt can) and run the whole suite,
## one worker per core (at most 4: each holds a JAX runtime); TEST_WORKERS=0 runs it in-process
TEST_WORKERS ?= auto
test: $(VENV)/.installed-dev $(VENV)/gpu-compile/.installed promtool lint
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal)

## make test-slow: the heavier variants kept out of `make test` (each has a lighter test covering
## its behaviour in the default run)
test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m slow $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal)

## make lint: unused imports and names, undefined names, and the rest of pyflakes' checks (ruff)
lint: $(VENV)/.installed-dev
	$(BIN)/ruff check --quiet --select F mbd_jax tests tools

# tests/test_deploy.py checks the alert rules with promtool (Debian's prometheus package).
promtool:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; }; } || \
	  echo "make: promtool is missing and could not be installed (Debian: apt-get install prometheus)"

## make bench: the decode benchmark on the default model (JSON on stdout, table on stderr)
bench: $(VENV)/.installed
	$(BIN)/mbd-jax bench decode --buffer-size 1,2,4 --json

## make models: retrain the shipped tokenizer, tiny-bd and tiny-mbd from scratch (fixed seeds;
## twelve stages, 28,900 steps: about 8.5 h on 2 CPU cores, see docs/training.md)
models: $(VENV)/.installed
	$(BIN)/python tools/train_tokenizer.py --tasks arith,sort,reverse,recall,sortrev --out configs/tokenizers/tasks --vocab 384
	rm -rf runs/recall-lookup runs/recall-then-mix runs/recall-then-mix-arith runs/mix-low-lr runs/mix-arith runs/long-lists runs/raw-marked runs/arith-recall runs/recall-two-keys runs/tiny-bd runs/tiny-mbd runs/tiny-mbd-model runs/tiny-mbd-structured
	$(BIN)/mbd-jax train --config configs/train/recall-lookup.yaml
	$(BIN)/mbd-jax train --config configs/train/recall-then-mix.yaml
	$(BIN)/mbd-jax train --config configs/train/recall-then-mix-arith.yaml
	$(BIN)/mbd-jax train --config configs/train/mix-low-lr.yaml
	$(BIN)/mbd-jax train --config configs/train/mix-arith.yaml
	$(BIN)/mbd-jax train --config configs/train/long-lists.yaml
	$(BIN)/mbd-jax train --config configs/train/raw-marked.yaml
	$(BIN)/mbd-jax train --config configs/train/arith-recall.yaml
	$(BIN)/mbd-jax train --config configs/train/recall-two-keys.yaml
	$(BIN)/mbd-jax train --config configs/train/tiny-bd.yaml --output models/tiny-bd --force
	$(BIN)/mbd-jax train --config configs/train/tiny-mbd.yaml
	$(BIN)/mbd-jax train --config configs/train/tiny-mbd-structured.yaml --force

clean:
	rm -rf $(VENV) build *.egg-info
