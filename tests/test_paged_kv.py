"""The paged KV pool: a pool far smaller than rows x context decodes exactly like one that holds
every row's full context (tokens identical, pages fragmented by earlier requests), page
accounting stays consistent under random request streams, a shared prefix is held once, the
service's queue waits for pages and loses nothing, and nothing compiles after warm-up."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from mbd_jax import compile_stats
from mbd_jax.config import DecodeConfig, ServeConfig, ServerConfig
from mbd_jax.engine import Engine
from mbd_jax.engine.pages import PagePool, page_keys, page_table
from mbd_jax.errors import UserError
from mbd_jax.serving.metrics import Metrics
from mbd_jax.serving.request import Request
from mbd_jax.serving.scheduler import Scheduler
from tests.conftest import tiny_cfg, tiny_params

PAGE = 64  # tiny-random: attention_chunk 64, block 8


def requests(seed: int, n: int) -> list[tuple[list[int], DecodeConfig]]:
    """Prompts of 3..150 tokens (up to three pages), half of them after one of two 2-page
    prefixes (pages other requests may share), with budgets that end at different times."""
    rng = np.random.default_rng(seed)
    vocab = tiny_cfg().vocab_size
    prefixes = [np.random.default_rng(100 + i).integers(5, vocab, 2 * PAGE).tolist() for i in (0, 1)]
    out = []
    for _ in range(n):
        prompt = rng.integers(5, vocab, int(rng.integers(3, 150))).tolist()
        if rng.random() < 0.5:
            prompt = prefixes[int(rng.integers(2))] + prompt[:20]
        out.append((prompt, DecodeConfig(buffer_size=int(rng.choice([1, 2])),
                                         max_new_tokens=int(rng.integers(4, 40)))))
    return out


@pytest.fixture(scope="module")
def full():
    """Every row can hold a full context at once (the dense design's memory); no prefix pages
    shared: the reference."""
    return Engine(tiny_cfg(), tiny_params(), batch_size=4, buffer_size=2, prefill_chunk=64,
                  share_prefixes=False)


def check_pool(engine: Engine) -> None:
    """The engine's pool accounting agrees with the pages its rows' records hold."""
    engine.pages.check([row.pages for _, row in engine.rows.items()])


@pytest.fixture(scope="module")
def small():
    """Room for about two requests' pages at a time, out of 4 rows x 17 pages."""
    e = Engine(tiny_cfg(), tiny_params(), batch_size=4, buffer_size=2, prefill_chunk=64,
               kv_pool_tokens=7 * PAGE)
    e.warmup()
    return e


def test_page_pool_accounting_under_random_reserve_and_release():
    rng = np.random.default_rng(0)
    pool = PagePool(num_pages=20, page=PAGE, pages_per_row=8)
    held: list[list[int]] = [[] for _ in range(5)]  # each row's pages (a row record's)
    for _ in range(2000):
        row = int(rng.integers(5))
        if rng.random() < 0.5:
            tokens = int(rng.integers(1, 8 * PAGE + 1))
            if pool.pages_for(tokens) <= pool.free + len(held[row]):
                pool.release(held[row])
                held[row] = pool.reserve(tokens)
                assert len(held[row]) == -(-tokens // PAGE)
        else:
            pool.release(held[row])
            held[row] = []
        pool.check(held)
        assert pool.in_use == sum(map(len, held)) <= 20
    table = page_table(dict(enumerate(held)), 5, 8, 20)
    for row, pages in enumerate(held):
        assert table[row, : len(pages)].tolist() == pages and (table[row, len(pages):] == 20).all()
    for row in range(5):
        pool.release(held[row])
    pool.check([])
    assert pool.free == 20 and not pool.refs.any()
    pool.refs[3] = 1  # a page held but also on the free list: the check sees it
    with pytest.raises(AssertionError):
        pool.check([[3]])


def test_small_pool_decodes_like_the_full_pool_under_a_random_request_stream(full, small):
    """Random admissions into free rows, cancellations and finishes on a pool that holds about
    two requests, with prompts that share prefix pages: every page is held, free or cached after
    each step, a finished request's tokens equal those of a full pool that shares nothing, all
    pages come back, and nothing compiles after warm-up."""
    work = requests(1, 14)
    reference = full.generate([p for p, _ in work], [d for _, d in work])
    rng = np.random.default_rng(2)
    before = compile_stats.compiles()
    state = small.empty_state()
    running: dict[int, int] = {}  # row -> request index
    queue, got, cancelled = list(range(len(work))), {}, set()
    peak = 0
    while queue or running:
        free_rows = [r for r in range(4) if r not in running]
        admit, pages = {}, small.pages.free
        for row in free_rows:  # FIFO while the pages last, as the scheduler does
            if queue and small.pages_to_admit(*work[queue[0]]) <= pages:
                pages -= small.pages_to_admit(*work[queue[0]])
                admit[row] = queue.pop(0)
        if admit:
            state = small.admit(state, {row: work[i] for row, i in admit.items()})
            running.update(admit)
        check_pool(small)
        peak = max(peak, small.pages.in_use)
        if running and rng.random() < 0.1:  # a client goes away
            row = int(rng.choice(list(running)))
            state = small.cancel(state, [row])
            cancelled.add(running.pop(row))
            small.release([row])
        state = small.decode_call(state, int(rng.integers(1, 6)))
        done = small.done_rows(state)
        finished = [row for row in running if done[row]]
        for row in finished:
            host = small.host_view(state)
            got[running.pop(row)] = small.result_of(host, row, 0.0).token_ids
        small.release(finished)
        check_pool(small)
    assert compile_stats.compiles() == before
    assert small.prefix_hit_tokens > 0  # some requests mapped another's prompt pages
    assert peak <= small.pages.num_pages == 7 and small.pages.in_use == 0
    assert not small.pages.refs.any()
    assert len(got) + len(cancelled) == len(work) and len(got) >= 8
    for i, tokens in got.items():
        assert tokens == reference[i].token_ids, i


@pytest.mark.parametrize("n_buf", [1, pytest.param(2, marks=pytest.mark.slow), 4])
def test_generate_waits_for_pages_and_matches_the_full_pool(n_buf):
    """MultiBD buffers 1, 2 and 4: `generate` on a pool that holds two of the requests at a
    time runs them in turns and returns the full pool's tokens; a request larger than the whole
    pool is refused by name."""
    cfg, params = tiny_cfg(), tiny_params()
    work = [(p, dataclasses.replace(d, buffer_size=n_buf)) for p, d in requests(3, 5)]
    prompts, decodes = [p for p, _ in work], [d for _, d in work]
    big = Engine(cfg, params, batch_size=4, buffer_size=n_buf, prefill_chunk=64)
    small = Engine(cfg, params, batch_size=4, buffer_size=n_buf, prefill_chunk=64,
                   kv_pool_tokens=6 * PAGE)
    want = [r.token_ids for r in big.generate(prompts, decodes)]
    assert [r.token_ids for r in small.generate(prompts, decodes)] == want
    per_row = small.pages.pages_per_row  # 17: max_seq_len 1024 + one 64-token write
    assert small.kv.nbytes() * 4 * per_row == big.kv.nbytes() * 6  # 6 pages against 4 x 17
    with pytest.raises(UserError, match=r"900 new tokens after a 3-token prompt need 15 KV pages .* has 6"):
        small.generate([[5, 6, 7]], DecodeConfig(buffer_size=n_buf, max_new_tokens=900))


def serve(engine: Engine, work: list[tuple[list[int], DecodeConfig]],
          kv_pool_tokens: int | None = None) -> list[tuple]:
    """Submits every request at once to a 4-row scheduler over `engine`; returns each one's
    last event (("done", result) or ("error", ...)) in order."""
    cfg = ServeConfig(model="tiny-test", decoding=DecodeConfig(buffer_size=2),
                      server=dataclasses.replace(ServerConfig(), max_batch_size=4, buffer_size=2,
                                                 steps_per_call=4, kv_pool_tokens=kv_pool_tokens))
    s = Scheduler(engine, cfg, Metrics())
    s.start()

    async def go():
        loop = asyncio.get_running_loop()
        reqs = [Request(id=f"r{i}", prompt=p, decode=d, loop=loop) for i, (p, d) in enumerate(work)]
        s.submit(reqs)
        out = []
        for r in reqs:
            while True:
                event = await asyncio.wait_for(r.events.get(), 120)
                if event[0] in ("done", "error"):
                    out.append(event)
                    break
        return out

    try:
        return asyncio.run(go())
    finally:
        s.stop()


def test_service_queue_waits_for_pages_and_loses_nothing(full, small):
    """Six requests on a 4-row scheduler whose pool holds about two: they queue, each waits for
    pages, all finish with the full pool's tokens, and every page is free afterwards."""
    work = requests(4, 6)
    reference = full.generate([p for p, _ in work], [d for _, d in work])
    small.reset_buffers()
    events = serve(small, work, kv_pool_tokens=7 * PAGE)
    assert [e[0] for e in events] == ["done"] * 6
    assert [e[1].token_ids for e in events] == [r.token_ids for r in reference]
    assert small.pages.in_use == 0
    check_pool(small)


def test_page_pool_prefix_index_under_random_streams():
    """Random reservations over shared prefixes, registrations and releases: every page is held,
    free or cached (never two), counts equal holders, a cached page is reused by a hit and
    evicted oldest first when pages run out, and everything returns at the end."""
    rng = np.random.default_rng(5)
    pool = PagePool(num_pages=24, page=PAGE, pages_per_row=8)
    held: list[list[int]] = [[] for _ in range(5)]
    prefixes = [np.random.default_rng(i).integers(5, 300, 4 * PAGE) for i in range(3)]
    hits = 0
    for _ in range(3000):
        row = int(rng.integers(5))
        if rng.random() < 0.5:
            prompt = np.concatenate([prefixes[int(rng.integers(3))][: int(rng.integers(0, 4 * PAGE))],
                                     rng.integers(5, 300, int(rng.integers(1, 2 * PAGE)))])
            keys = page_keys(prompt, PAGE, len(prompt) // 8 * 8)
            pool.release(held[row])
            held[row] = []
            shared = pool.lookup(keys)
            tokens = int(len(prompt) + rng.integers(1, 2 * PAGE))
            if pool.pages_for(tokens) < len(shared) or pool.cost(tokens, shared) > pool.free:
                continue
            hits += len(shared) > 0
            free_before = pool.free
            held[row] = pool.reserve(tokens, shared=shared)
            assert pool.free == free_before - pool.cost(tokens, []) + len(shared) - sum(
                1 for p in shared if pool.refs[p] == 1)  # the cost it was quoted
            assert held[row][: len(shared)] == shared
            pool.register(held[row], keys)
        else:
            pool.release(held[row])
            held[row] = []
        pool.check(held)
    assert hits > 100
    for row in range(5):
        pool.release(held[row])
    pool.check([])
    assert pool.in_use == 0 and pool.free == 24 and not pool.refs.any()
    # eviction eats a cached prefix from its end: what stays is still reachable
    pool = PagePool(num_pages=6, page=PAGE, pages_per_row=6)
    keys = page_keys(prefixes[0], PAGE, 4 * PAGE)
    pages = pool.reserve(4 * PAGE)
    pool.register(pages, keys)
    pool.release(pages)
    assert pool.cached == 4 and pool.lookup(keys) == pages
    other = pool.reserve(4 * PAGE)  # 2 free pages, then the 2 oldest cached: the prefix's last two
    pool.check([other])
    assert pool.lookup(keys) == pages[:2] and pool.cached == 2


def test_a_shared_prefix_is_held_once_and_decodes_like_no_sharing():
    """A 3-page system prompt: the first request prefills it; three more arrive while it runs
    and map its pages (held once, four references) instead of prefilling them; every answer
    equals an engine that shares nothing; after they finish the pages stay cached and a later
    request with the same prefix maps them again. The four admitted together (generate, a
    burst at the service) share the same way: the later three wait for the first's prefill."""
    cfg, params = tiny_cfg(), tiny_params()
    rng = np.random.default_rng(6)
    system = rng.integers(5, cfg.vocab_size, 3 * PAGE).tolist()
    work = [(system + rng.integers(5, cfg.vocab_size, int(n)).tolist(),
             DecodeConfig(buffer_size=2, max_new_tokens=int(m)))
            for n, m in zip(rng.integers(3, 40, 5), rng.integers(16, 40, 5))]
    plain = Engine(cfg, params, batch_size=4, buffer_size=2, prefill_chunk=64,
                   share_prefixes=False)
    want = [r.token_ids for r in plain.generate([p for p, _ in work], [d for _, d in work])]
    eng = Engine(cfg, params, batch_size=4, buffer_size=2, prefill_chunk=64)
    state = eng.admit(eng.empty_state(), {0: work[0]})
    shared = eng.rows[0].pages[:3]
    assert eng.pages.index and eng.prefix_hit_tokens == 0
    own = {0: eng.pages_needed(*work[0])}
    assert eng.pages_to_admit(*work[1]) == eng.pages_needed(*work[1]) - 3
    state = eng.admit(state, {r: work[r] for r in (1, 2, 3)})
    for r in (1, 2, 3):
        assert eng.rows[r].pages[:3] == shared
        own[r] = eng.pages_needed(*work[r]) - 3
    assert eng.pages.refs[shared].tolist() == [4, 4, 4]
    assert eng.pages.in_use == sum(own.values())  # the prefix counted once
    assert eng.prefix_hit_tokens == 3 * 3 * PAGE
    check_pool(eng)
    state = eng.run_decode(state)
    host = jax.device_get(state)
    assert [eng.result_of(host, r, 0.0).token_ids for r in range(4)] == want[:4]
    eng.release(range(4))
    assert eng.pages.cached == 3 + 0 and eng.pages.in_use == 0  # only whole prompt pages cached
    state = eng.admit(eng.empty_state(), {2: work[4]})
    assert eng.rows[2].pages[:3] == shared and eng.prefix_hit_tokens == 4 * 3 * PAGE
    state = eng.run_decode(state)
    assert eng.result_of(jax.device_get(state), 2, 0.0).token_ids == want[4]
    check_pool(eng)

    # Admitted together (generate's one batch; a burst at the service): the first prompt is
    # prefilled, the others wait for it and then map its pages instead of prefilling copies.
    for run in ("generate", "service"):
        eng.reset_buffers()
        hits = eng.pool_hit_tokens
        if run == "generate":
            got = [r.token_ids for r in eng.generate([p for p, _ in work[:4]],
                                                     [d for _, d in work[:4]])]
            # each row gave its pages back as it finished; the shared prefix stays cached
            assert eng.pages.in_use == 0 and eng.pages.cached == 3
        else:
            got = [e[1].token_ids for e in serve(eng, work[:4])]
        assert got == want[:4], run
        assert eng.pool_hit_tokens - hits == 3 * 3 * PAGE, run
        check_pool(eng)


def test_an_8k_context_on_a_one_request_pool_equals_dense_attention():
    """An 8K-token prompt prefilled in 2048-token chunks into a pool that holds one such request
    (half of what two full rows would take): the logits of its first decode forward, through the
    paged online-softmax loop, equal dense masked attention over the same row (the reference
    path) on an engine with a full pool."""
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer

    n = 8000
    cfg = tiny_cfg(max_seq_len=n + 256)
    params = tiny_params(max_seq_len=n + 256)
    prompt = np.random.default_rng(8).integers(5, cfg.vocab_size, n).tolist()
    decode = DecodeConfig(buffer_size=1, max_new_tokens=16)

    def first_logits(c, engine):
        state = engine.admit(engine.empty_state(), {1: (prompt, decode)})
        host = jax.device_get(state)
        start = int(host.cached_len[1])
        window = host.canvas[1:2, start:start + c.block_size]
        meta = ForwardMeta.cached(start + np.arange(c.block_size, dtype=np.int32)[None],
                                  np.array([start], np.int32),
                                  np.array([start + c.block_size], np.int32),
                                  rows=np.array([1], np.int32))
        fwd = jax.jit(lambda p, t, m, kv: Transformer(c).apply({"params": p}, t, m, kv)[0])
        return np.asarray(fwd(engine.params, window, meta, engine.kv))[0]

    paged = Engine(cfg, params, batch_size=2, prefill_chunk=2048,
                   kv_pool_tokens=n + 256)
    assert paged.pages.num_pages < paged.pages.pages_per_row * 2
    got = first_logits(cfg, paged)
    assert len(paged.rows[1].pages) == paged.pages_needed(prompt, decode)
    dense_cfg = dataclasses.replace(cfg, attention_impl="dense")
    want = first_logits(dense_cfg, Engine(dense_cfg, params, batch_size=2, prefill_chunk=2048))
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(want).max() > 0.1  # real logits, not padding


def test_a_one_shot_warmup_covers_what_shared_prefixes_prefill():
    """`prefill_buckets_for` follows generate's sharing: the second prompt waits for the first,
    maps its page and prefills its own 24 tokens (bucket 32), where prefilled together the two
    would have shared one 32-token call and never run the first's last 8 alone. Nothing
    compiles after that warm-up."""
    eng = Engine(tiny_cfg(), tiny_params(), batch_size=2, buffer_size=1, prefill_chunk=64)
    shared = list(range(10, 10 + PAGE))
    prompts = [shared + [80] * 8 + [3], shared + [90] * 24 + [3]]  # 72 and 88 full-block tokens
    assert eng.prefill_buckets_for(prompts) == [8, 32, 64]
    eng.warmup(buckets=eng.prefill_buckets_for(prompts))
    warm = compile_stats.compiles()
    eng.generate(prompts, DecodeConfig(max_new_tokens=8))
    assert compile_stats.compiles() == warm
    assert eng.pool_hit_tokens == PAGE
