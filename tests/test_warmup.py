"""A warm-up that returns before the larger prefill buckets compile (the service's readiness):
requests are served at once on the smallest bucket, nothing compiles on their path, and the
larger buckets take over as a background thread compiles them."""

import threading

from mbd_jax import compile_stats
from mbd_jax.cache.prefix_store import PrefixStore
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine, programs

DECODE = DecodeConfig(max_new_tokens=8)


def engine_with_store(cfg, params) -> Engine:
    # pool prefix sharing off: a repeated prompt is loaded from the prefix store, whose load
    # programs are compiled per bucket too
    return Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=32, share_prefixes=False,
                  prefix_store=PrefixStore("m", cfg.block_size, ram_bytes=1 << 24))


def test_served_on_the_smallest_bucket_until_the_larger_ones_compile(cfg, params):
    """Block 8, prefill_chunk 32: the warm-up compiles the 8-token bucket and returns; a 29-token
    prompt (and the same prompt again, loaded from the prefix store) is then served in 8-token
    chunks with no compile at all, while the background thread is held before its first
    compile. Released, it compiles 16 and 32 (prefill and store loads); from then on prompts
    take 32-token chunks, still with no compile, and every answer is a fully warmed engine's."""
    programs.clear()  # a fresh process: nothing compiled by an earlier test's engine
    prompts = [list(range(10, 39)), list(range(40, 75))]  # 29 and 35 tokens
    want = [r.token_ids for r in engine_with_store(cfg, params).generate(prompts, DECODE)]

    programs.clear()
    engine = engine_with_store(cfg, params)
    release, held = threading.Event(), threading.Event()

    def progress(message: str) -> None:
        if "background" in message and not release.is_set():
            held.set()
            release.wait(120)

    engine.warmup(progress, background=True)
    assert held.wait(60) and engine.prefill_ready == cfg.block_size
    chunks: list[int] = []  # tokens per row of every prefill call
    run_prefill = engine.runner.prefill
    engine.runner.prefill = lambda host: (chunks.append(host[0].shape[1]), run_prefill(host))[1]
    before = compile_stats.compiles()
    early = [engine.generate([prompts[0]], DECODE)[0].token_ids for _ in range(2)]
    assert compile_stats.compiles() == before  # nothing compiled on the requests' path
    assert chunks == [8, 8, 8]  # three full prompt blocks, then the second time none: stored
    assert engine.stats().prefix_hit_tokens == 24
    assert early == [want[0]] * 2

    release.set()
    assert engine.background.done.wait(120)
    assert engine.prefill_ready == engine.prefill_chunk == 32
    warm, chunks[:] = compile_stats.compiles(), []
    late = [r.token_ids for r in engine.generate(prompts, DECODE)]  # a 24-token store load
    assert compile_stats.compiles() == warm  # nothing compiles after the background is done
    assert chunks == [32] and late == want  # the 35-token prompt's 32 full-block tokens at once
    assert engine.stats().prefix_hit_tokens == 48
    assert engine.close()


def test_a_background_told_to_stop_keeps_the_buckets_it_has(cfg, params):
    """A progress callback that raises (a service stopping) ends the background compiles before
    their first bucket: the engine serves on with the 8-token bucket, compiling nothing, and
    closes at once."""
    programs.clear()
    engine = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=32)
    seen = []

    def progress(message: str) -> None:
        seen.append(message)
        if "background" in message:
            raise RuntimeError("stopping")

    engine.warmup(progress, background=True)
    assert engine.close(60)  # the thread has ended (or ends now, before any compile)
    assert sum("background" in m for m in seen) == 1 and not engine.background.done.is_set()
    assert engine.prefill_ready == 8
    before = compile_stats.compiles()
    (result,) = engine.generate([list(range(10, 40))], DECODE)
    assert compile_stats.compiles() == before and len(result.token_ids) == 8
