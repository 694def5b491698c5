"""KV persistence: the prefix store's tiers (capacity, LRU, TTL, corruption, restart) and the
engine's cache path (exactness against a cold prefill, restart reuse, overlap of the offload)."""

from __future__ import annotations

import logging
import os
import pathlib
import threading

import jax
import numpy as np
import pytest

from mbd_jax.cache.prefix_store import PrefixStore, block_keys, state_key
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.engine.pages import page_keys
from mbd_jax.engine.rows import EngineRequest
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer
from tests.conftest import tiny_cfg, tiny_params

ENTRY = (3, 2, 8, 2, 16)  # [L, 2, blk, K, Dh] of the tiny preset
ENTRY_BYTES = int(np.prod(ENTRY)) * 4


def entry(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(ENTRY).astype(np.float32)


class Clock:
    def __init__(self):
        import time

        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_keys_chain_the_whole_prefix():
    a = block_keys("m", list(range(24)), 8)
    b = block_keys("m", list(range(16)) + [99] * 8, 8)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert block_keys("m", [5] + list(range(1, 24)), 8)[1] != a[1]  # block 1 depends on block 0
    assert block_keys("other-model", list(range(24)), 8)[0] != a[0]
    assert block_keys("m", list(range(24)), 8, known=a[:1]) == a


def test_ram_tier_respects_its_bytes_in_lru_order():
    store = PrefixStore("m", 8, ram_bytes=3 * ENTRY_BYTES)
    for i in range(3):
        store.put(f"k{i}", entry(i))
    assert store.get("k0") is not None  # k0 becomes the most recently used
    store.put("k3", entry(3))
    assert store.stats.ram_bytes <= 3 * ENTRY_BYTES and store.stats.evictions == 1
    assert store.get("k1") is None  # the least recently used went first
    np.testing.assert_array_equal(store.get("k0"), entry(0))
    for i in range(4, 20):
        store.put(f"k{i}", entry(i))
        assert store.stats.ram_bytes <= 3 * ENTRY_BYTES


def test_disk_tier_survives_a_restart_and_expires(tmp_path):
    clock = Clock()
    first = PrefixStore("m", 8, ram_bytes=ENTRY_BYTES, storage_path=tmp_path,
                        disk_bytes=10 * ENTRY_BYTES, ttl_s=60, clock=clock)
    for i in range(3):
        first.put(f"k{i}", entry(i))
    first.flush()
    second = PrefixStore("m", 8, ram_bytes=ENTRY_BYTES, storage_path=tmp_path,
                         disk_bytes=10 * ENTRY_BYTES, ttl_s=60, clock=clock)
    assert second.stats.disk_bytes > 3 * ENTRY_BYTES
    for i in range(3):
        np.testing.assert_array_equal(second.get(f"k{i}"), entry(i))
    other_model = PrefixStore("m2", 8, ram_bytes=ENTRY_BYTES, storage_path=tmp_path,
                              disk_bytes=10 * ENTRY_BYTES)
    assert other_model.get("k0") is None
    clock.now += 61
    third = PrefixStore("m", 8, ram_bytes=ENTRY_BYTES, storage_path=tmp_path,
                        disk_bytes=10 * ENTRY_BYTES, ttl_s=60, clock=clock)
    assert third.get("k1") is None and third.stats.evictions == 1  # expired: dropped, not used


def test_disk_tier_capacity_drops_the_oldest(tmp_path):
    store = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=3 * ENTRY_BYTES + 500)
    for i in range(6):
        store.put(f"k{i}", entry(i))
        store.flush()
        files = list(tmp_path.rglob("*.kv"))
        assert sum(f.stat().st_size for f in files) <= 3 * ENTRY_BYTES + 500
    assert store.get("k0") is None and store.get("k5") is not None


def _header_offset(field: str) -> int:
    """Byte offset of a header field in a disk entry (magic 8, digest 32, n 8, dtype 16, shape)."""
    return {"digest": 8, "length": 40, "dtype": 48, "shape": 64, "shape_pad": 64 + 5 * 8}[field]


@pytest.mark.parametrize("damage", ["truncate", "payload", "digest", "length", "dtype", "shape",
                                    "shape_pad", "swapped"])
def test_damaged_entry_is_detected_removed_and_rewritten(tmp_path, damage, caplog):
    """Any flipped bit (payload or any header field, including a zero shape slot turned 1, which
    still reshapes), a truncation, or a valid entry copied over another key's file is caught on
    read: never used, removed, counted; the next offload of the block writes it again."""
    store = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=1 << 20)
    store.expect(ENTRY, np.float32)
    store.put("k0", entry(0))
    store.put("k1", entry(1))
    store.flush()
    (path,) = tmp_path.rglob("k0.kv")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "payload":
        data[-7] ^= 0x10
    elif damage == "swapped":
        data = bytearray(next(tmp_path.rglob("k1.kv")).read_bytes())
    else:
        data[_header_offset(damage)] ^= 0x01
    path.write_bytes(bytes(data))
    restarted = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=1 << 20)
    restarted.expect(ENTRY, np.float32)
    for s in (store, restarted):
        with caplog.at_level(logging.WARNING, logger="mbd_jax.cache"):
            assert s.get("k0") is None
    assert store.stats.corrupt == 1 and "corrupt" in caplog.text and not path.exists()
    assert "k0" not in store and "k0" not in restarted
    np.testing.assert_array_equal(restarted.get("k1"), entry(1))  # the other entry is fine
    store.put("k0", entry(0))  # the next offload of that block rewrites it
    store.flush()
    np.testing.assert_array_equal(PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path,
                                              disk_bytes=1 << 20).get("k0"), entry(0))


def test_entry_of_another_layout_is_never_served(tmp_path):
    """A well-formed entry whose shape is not the engine's (another model's files, an old
    layout) counts as corrupt and is removed instead of reaching the device."""
    store = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=1 << 20)
    store.put("k0", np.zeros((3, 2, 8, 2, 8), np.float32))
    store.flush()
    strict = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=1 << 20)
    strict.expect(ENTRY, np.float32)
    assert strict.get("k0") is None and strict.stats.corrupt == 1
    with pytest.raises(ValueError, match="not the expected"):
        strict.put("k1", np.zeros((3, 2, 8, 2, 8), np.float32))


def test_state_snapshots_are_a_second_kind_with_their_own_layout(tmp_path):
    """A hybrid's state snapshots (key: the block's and a suffix) are checked against their own
    layout, survive a restart, and a lookup that needs one stops at the last block that has it."""
    state = np.arange(6, dtype=np.float32).reshape(2, 3)
    tokens = list(range(40))  # 5 blocks
    store = PrefixStore("m", 8, ram_bytes=1 << 20, storage_path=tmp_path, disk_bytes=1 << 20)
    store.expect(ENTRY, np.float32)
    store.expect(state.shape, np.float32, kind="state")
    keys = store.keys(tokens)
    for i, key in enumerate(keys[:4]):
        store.put(key, entry(i))
    store.put(state_key(keys[1]), state)
    with pytest.raises(ValueError, match=r"not the expected \(\(2, 3\), dtype\('float32'\)\)"):
        store.put(state_key(keys[2]), np.zeros(ENTRY, np.float32))
    found, got = store.lookup_with_state(tokens)
    assert len(found) == 2 and np.array_equal(got, state) and store.stats.hits == 2
    assert store.stats.misses == 3  # five blocks asked, two usable
    store.flush()
    again = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=1 << 20)
    again.expect(ENTRY, np.float32)
    again.expect((2, 4), np.float32, kind="state")  # another layout: the file is not served
    assert again.lookup_with_state(tokens) == ([], None) and again.stats.corrupt == 1


def test_disk_index_answers_without_touching_the_directory(tmp_path, monkeypatch):
    """After startup, membership, capacity eviction and writes use the in-memory index: no
    directory listing or stat of other files on the write path (it used to glob every file)."""
    store = PrefixStore("m", 8, ram_bytes=0, storage_path=tmp_path, disk_bytes=5 * ENTRY_BYTES + 900)
    listed = []
    monkeypatch.setattr(pathlib.Path, "glob", lambda *a, **k: listed.append(a) or iter(()))
    monkeypatch.setattr(os, "scandir", lambda *a, **k: listed.append(a) or iter(()))
    for i in range(12):
        store.put(f"k{i}", entry(i))
    store.flush()
    assert listed == []
    assert store.stats.disk_entries == 5 and store.stats.evictions == 7
    assert "k11" in store and "k0" not in store
    assert len(list(os.listdir(store._disk))) == 5


def test_a_full_write_queue_drops_disk_copies_instead_of_waiting(tmp_path, monkeypatch):
    from mbd_jax.cache import prefix_store

    monkeypatch.setattr(prefix_store, "MAX_PENDING_WRITES", 2)
    store = PrefixStore("m", 8, ram_bytes=1 << 24, storage_path=tmp_path, disk_bytes=1 << 24)
    gate = threading.Event()
    real_write = store._write_disk
    monkeypatch.setattr(store, "_write_disk", lambda k, e: (gate.wait(), real_write(k, e)))
    for i in range(6):
        store.put(f"k{i}", entry(i))  # returns at once: the writer is stuck on the first
    assert store.stats.disk_dropped >= 3
    assert all(store.get(f"k{i}") is not None for i in range(6))  # RAM has every block
    gate.set()
    store.flush()
    assert store.stats.disk_entries == 6 - store.stats.disk_dropped


def test_unwritable_disk_warns_and_ram_keeps_serving(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="mbd_jax.cache"):
        store = PrefixStore("m", 8, ram_bytes=1 << 20, storage_path=blocker, disk_bytes=1 << 20)
        store.put("k0", entry(0))
    assert "serving continues from RAM" in caplog.text and store.stats.disk_errors >= 1
    np.testing.assert_array_equal(store.get("k0"), entry(0))


# ------------------------------------------------------------------------------- the engine

def make_engine(store=None, batch=2, share_prefixes=True, kv_pool_tokens=None):
    cfg, params = tiny_cfg(), tiny_params()
    engine = Engine(cfg, params, batch_size=batch, buffer_size=2, prefill_chunk=32,
                    prefix_store=store, share_prefixes=share_prefixes,
                    kv_pool_tokens=kv_pool_tokens)
    engine.warmup()
    return engine


def first_step_logits(engine: Engine, prompt: list[int], row: int = 0) -> np.ndarray:
    """Admits `prompt` into `row` and returns the logits of the first decode forward over its
    window, computed from the engine's KV buffer (the prefilled or cache-loaded prefix)."""
    cfg = engine.cfg
    state = engine.admit(engine.empty_state(), {row: (prompt, DecodeConfig(buffer_size=2))})
    host = jax.device_get(state)
    start = int(host.cached_len[row])
    window = host.canvas[row:row + 1, start:start + 2 * cfg.block_size]
    pos = start + np.arange(window.shape[1], dtype=np.int32)[None]
    meta = ForwardMeta.cached(pos, np.array([start], np.int32),
                              np.array([start + window.shape[1]], np.int32),
                              rows=np.array([row], np.int32))  # over that cache row alone
    logits, _ = Transformer(cfg).apply({"params": engine.params}, window, meta, engine.kv)
    return np.asarray(logits[0])


PROMPT_LEN = 45  # 5 full blocks of 8 and a partial one


def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 500, size=PROMPT_LEN).tolist()
    other = shared[:33] + rng.integers(10, 500, size=12).tolist()  # shares 4 blocks
    return shared, other


def test_cache_hit_is_exact_and_survives_a_restart(tmp_path):
    shared, other = prompts()
    d = DecodeConfig(buffer_size=2, max_new_tokens=16)
    cold = make_engine()
    cold_out = [r.token_ids for r in cold.generate([shared, other], d)]
    cold_logits = [first_step_logits(cold, p) for p in (shared, other)]

    store = PrefixStore("tiny", 8, ram_bytes=1 << 24, storage_path=tmp_path, disk_bytes=1 << 24)
    warm = make_engine(store)
    assert warm.generate([shared], d)[0].token_ids == cold_out[0]  # miss: stores its blocks
    warm.offloader.flush()
    assert store.stats.hits == 0 and len(list(tmp_path.rglob("*.kv"))) >= 5
    hit_out = [r.token_ids for r in warm.generate([shared, other], d)]
    assert store.stats.hits == 5 + 4  # every full prompt block of `shared`, 4 of `other`
    assert hit_out == cold_out
    for p, ref in zip((shared, other), cold_logits):
        np.testing.assert_array_equal(first_step_logits(warm, p), ref)

    # a second engine on the same storage path (a restart) reuses the first one's blocks
    warm.offloader.close()
    store2 = PrefixStore("tiny", 8, ram_bytes=1 << 24, storage_path=tmp_path, disk_bytes=1 << 24)
    again = make_engine(store2)
    assert [r.token_ids for r in again.generate([shared, other], d)] == cold_out
    # all 5 full blocks of both prompts now: the warm engine stored `other`'s fifth block too
    assert store2.stats.hits == 10 and store2.stats.misses == 0 and store2.stats.ram_bytes > 0
    np.testing.assert_array_equal(first_step_logits(again, other), cold_logits[1])


def test_offload_overlaps_the_decode_loop():
    """With persistence on, each staged buffer is handed to the drain thread only after the next
    decode call was issued, so its host copy overlaps that call, and everything staged is drained.
    The engine thread never waits: a call that finds both buffers still draining stages nothing
    and leaves its blocks for a later call (deferred_calls)."""
    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = make_engine(store, batch=4)
    rng = np.random.default_rng(3)
    ps = [rng.integers(10, 500, size=int(n)).tolist() for n in (20, 37, 51, 64)]
    engine.steps_per_call = 2  # many decode calls, blocks committed in most of them
    engine.generate(ps, DecodeConfig(buffer_size=2, max_new_tokens=40))
    engine.offloader.flush()
    off = engine.offloader
    assert off.stats.staged_blocks == off.stats.drained_blocks > 10, off.stats
    decode_t = {c: t for what, c, t in off.events if what == "decode"}
    drained = [(c, t) for what, c, t in off.events if what == "drain"]
    staged_calls = [c for what, c, _ in off.events if what == "staged"]
    assert len(drained) == len(staged_calls) > 5, off.events
    assert off.stats.blocking_waits == 0, (off.stats, off.events)  # deferred, never waited
    for c, t in drained[:-1]:  # the last one is drained by flush()
        assert c in decode_t and t > decode_t[c], ("drained before the next decode call", off.events)
    assert len(store._ram) == off.stats.drained_blocks, (len(store._ram), off.stats)


def test_blocks_reach_the_store_when_the_engine_goes_idle():
    """A batch that ends in one decode call leaves its blocks staged with no later call to hand
    them over: going idle does, so the same prompt sent right after hits (no flush here)."""
    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = make_engine(store)
    engine.steps_per_call = 64  # the whole reply in one decode call
    prompt = np.random.default_rng(7).integers(10, 500, size=35).tolist()  # 4 full blocks
    d = DecodeConfig(buffer_size=2, max_new_tokens=8)
    before = engine.stats()
    first = engine.generate([prompt], d)[0].token_ids
    assert len(engine.stats().calls_since(before)) == 1
    staged = engine.offloader._last  # what that one call staged: handed over on going idle
    assert staged is not None and staged.handed and len(staged.keys) >= 4
    assert staged.drained.wait(timeout=120)  # the drain thread's own pace, not a verdict
    assert engine.generate([prompt], d)[0].token_ids == first
    assert store.stats.hits == 4


def test_a_released_rows_unstaged_blocks_are_never_stored_from_a_stale_table():
    """One block staged per call, so a short request finishes with most of its blocks not yet
    staged while a long one keeps decoding: those blocks are not persisted after its row is
    released (its pages were given back; reading them through the row's cleared table gave
    zeros), and what was stored serves a hit whose logits equal a cold prefill's."""
    cfg, params = tiny_cfg(), tiny_params()
    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=32,
                    prefix_store=store, offload_blocks_per_call=1)
    engine.steps_per_call = 4
    rng = np.random.default_rng(12)
    short, long = (rng.integers(10, 500, size=n).tolist() for n in (131, 35))  # 16, 4 blocks
    engine.generate([short, long], [DecodeConfig(buffer_size=2, max_new_tokens=8),
                                    DecodeConfig(buffer_size=2, max_new_tokens=120)])
    engine.offloader.flush()
    stored = [k for k in store.keys(short) if k in store]
    assert 0 < len(stored) < 16, stored  # some of its prompt blocks were staged before it ended
    for key in list(store._ram):
        assert np.abs(store.get(key)).max() > 0, "a block of zeros was stored"
    cold = make_engine()
    np.testing.assert_array_equal(first_step_logits(engine, short),
                                  first_step_logits(cold, short))


def test_a_resend_finds_blocks_still_on_their_way_to_the_store():
    """The drain thread is slow here (every store write waits on a gate the test holds shut), so
    the blocks of the first reply are staged but not stored when the same prompt comes again:
    the lookup waits for the buffer that holds them (settle) and hits, whatever the drain
    thread's pace; with the gate left shut it could not finish."""
    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = make_engine(store)
    gate = threading.Event()
    put = store.put

    def slow_put(key, entry):
        gate.wait()
        put(key, entry)

    store.put = slow_put
    prompt = np.random.default_rng(11).integers(10, 500, size=35).tolist()  # 4 full blocks
    d = DecodeConfig(buffer_size=2, max_new_tokens=8)
    first = engine.generate([prompt], d)[0].token_ids
    assert not any(k in store for k in store.keys(prompt))  # nothing stored yet
    assert engine.offloader.stats.settle_waits == 0
    threading.Timer(0.5, gate.set).start()  # the disk answers late
    assert engine.generate([prompt], d)[0].token_ids == first
    assert store.stats.hits == 4 and engine.offloader.stats.settle_waits == 1


def test_a_lookup_is_counted_once_whether_prefetched_or_not():
    """The store's hit and miss counts (the hit-ratio metric) count each admission's lookup
    once: a prefetch that found nothing and the admission's own look do not both count."""
    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = make_engine(store, share_prefixes=False)
    rng = np.random.default_rng(11)
    cold, warm = (rng.integers(10, 500, size=35).tolist() for _ in range(2))  # 4 full blocks

    def admit(row, prompt, prefetch):  # as the scheduler does
        hit = engine.prefetch(prompt) if prefetch else None
        adm = engine.begin_admit({row: EngineRequest(prompt, DecodeConfig(), prefix=hit)})
        while not engine.prefill_step(adm):
            pass
        engine.finish_admit(engine.empty_state(), adm)

    admit(0, cold, prefetch=True)
    assert (store.stats.hits, store.stats.misses) == (0, 4)
    block = np.zeros(ModelCache.block_shape(engine.cfg, 8), engine.kv.block_dtype)
    for key in store.keys(warm)[:2]:  # the first two blocks stored, the third not
        store.put(key, block)
    admit(1, warm, prefetch=True)
    assert (store.stats.hits, store.stats.misses) == (2, 6)
    admit(1, warm, prefetch=False)  # looked up at admission
    assert (store.stats.hits, store.stats.misses) == (4, 8)


def test_the_store_serves_what_the_pool_evicted():
    """The store is the tier below the pool: a prompt whose leading page is still in the pool
    and whose later blocks were evicted maps that page and loads the rest from the store,
    prefilling only its partial block; the tokens equal a run with no cache at all."""
    rng = np.random.default_rng(11)
    a = rng.integers(10, 500, size=205).tolist()  # 3 whole pages of 64, 25 full blocks of 8
    b = rng.integers(10, 500, size=400).tolist()
    d = DecodeConfig(buffer_size=2, max_new_tokens=16)
    cold = [r.token_ids for r in make_engine(share_prefixes=False).generate([a, b, a], d)]

    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    engine = make_engine(store, kv_pool_tokens=8 * 64)
    assert engine.pages_needed(a, d) == 4 and engine.pages_needed(b, d) == 7
    a_pages = page_keys(a, 64, 200)  # a's 3 whole prompt pages
    assert engine.generate([a], d)[0].token_ids == cold[0]
    assert len(engine.pages.lookup(a_pages)) == 3
    # a's row released, b takes its 1 unindexed page and the 4 never used, and evicts 2 of the
    # 3 cached ones: a's last pages go first
    assert engine.generate([b], d)[0].token_ids == cold[1]
    assert len(engine.pages.lookup(a_pages)) == 1
    engine.offloader.flush()
    hits, served = store.stats.hits, engine.prefix_hit_tokens
    assert engine.generate([a], d)[0].token_ids == cold[2]
    assert engine.prefix_hit_tokens - served == 200  # a's 25 full blocks: none prefilled
    assert store.stats.hits - hits == 200 // 8 - 64 // 8  # all but the pool's one page
    engine.pages.check([row.pages for _, row in engine.rows.items()])


def test_warm_engine_with_a_cache_compiles_nothing_new():
    from mbd_jax import compile_stats

    store = PrefixStore("tiny", 8, ram_bytes=1 << 24)
    # the store's loads are what is compiled here: the pool's own prefix pages would serve
    # these prompts first (a pool hit compiles nothing: tests/test_paged_kv.py)
    engine = make_engine(store, batch=2, share_prefixes=False)
    before = compile_stats.compiles()
    rng = np.random.default_rng(5)
    shared = rng.integers(10, 500, size=120).tolist()  # hits span several load chunks / buckets
    d = DecodeConfig(buffer_size=2, max_new_tokens=12)
    engine.generate([shared[:70], shared[:17]], d)  # misses
    engine.offloader.flush()
    engine.generate([shared[:70] + [7, 8, 9], shared + [3]], d)  # hits of 8 and 8+ blocks
    engine.offloader.flush()
    assert store.stats.hits >= 8
    assert compile_stats.compiles() == before
