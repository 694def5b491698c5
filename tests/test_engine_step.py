"""Engine.step(), the one engine step every driver uses: a driver that offers requests as rows
free up gets generate()'s tokens, each row's events add up to its result, and end() frees or
finishes a row at the next step."""

from __future__ import annotations

import numpy as np
import pytest

from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.engine.rows import EngineRequest
from tests.conftest import tiny_cfg, tiny_params

DECODE = DecodeConfig(buffer_size=2, max_new_tokens=24)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_cfg(), tiny_params(), batch_size=2, buffer_size=2, prefill_chunk=32,
                  steps_per_call=4)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(5, 200, int(k)).tolist() for k in rng.integers(3, 30, n)]


def drive(engine: Engine, requests: list[EngineRequest], end_after: dict | None = None):
    """Offers the waiting requests at every step (a queue, as the service does) until every row
    is done; returns ({request id: result}, {request id: streamed tokens}, steps)."""
    waiting, results, streamed, steps = list(requests), {}, {r.id: [] for r in requests}, 0
    while waiting or len(engine.rows):
        out = engine.step(waiting)
        assert out.error is None, out.error
        waiting = [r for r in waiting if r not in out.admitted]
        for event in out.events:
            streamed[event.request.id] += event.tokens
            if event.finished:
                results[event.request.id] = event.result(0.0)
            how = (end_after or {}).get(event.request.id)
            if how and len(streamed[event.request.id]) and not event.finished:
                engine.end(event.request, how)
                end_after.pop(event.request.id)
        steps += 1
        assert steps < 500
    return results, streamed, steps


def test_a_queue_of_requests_stepped_gets_generates_tokens(engine):
    """Five requests through two rows, refilled as rows free up (continuous batching): each
    result equals generate()'s, and its streamed tokens are exactly its result's tokens (the EOS
    aside)."""
    ps = prompts(5)
    want = [r.token_ids for r in engine.generate(ps, DECODE)]
    requests = [EngineRequest(p, DECODE) for p in ps]
    results, streamed, _ = drive(engine, requests)
    assert [results[r.id].token_ids for r in requests] == want
    for r in requests:
        assert streamed[r.id][: len(want[requests.index(r)])] == results[r.id].token_ids
    assert engine.stats().pages_in_use == 0 and len(engine.rows) == 0


def test_end_cancel_frees_the_row_and_stop_finishes_with_what_was_handed_out(engine):
    ps = prompts(3)
    long = DecodeConfig(buffer_size=2, max_new_tokens=64, ignore_eos=True)
    requests = [EngineRequest(p, long) for p in ps]
    results, streamed, _ = drive(engine, requests,
                                 end_after={requests[0].id: "cancel", requests[1].id: "stop"})
    assert requests[0].id not in results  # cancelled: no result, its row went to the third
    stopped = results[requests[1].id]
    assert stopped.finish_reason == "stop" and stopped.token_ids == streamed[requests[1].id]
    assert 0 < len(stopped.token_ids) < 64
    assert len(results[requests[2].id].token_ids) == 64
    assert engine.stats().pages_in_use == 0
    with pytest.raises(ValueError, match="expected 'cancel' or 'stop'"):
        engine.end(requests[0], "later")


def test_a_failed_admission_fails_only_its_request(engine):
    """A request whose settings break on their way to the device (max_nfe past int32, which no
    check caught) fails alone, reported in the outcome; the engine serves the next one."""
    bad = EngineRequest(prompts(1)[0], DecodeConfig(buffer_size=2, max_nfe=2**40))
    out = engine.step([bad])
    assert out.admitted == [bad] and out.failed == [bad] and not out.decode_failed
    assert isinstance(out.error, OverflowError) and len(engine.rows) == 0
    good = EngineRequest(prompts(1)[0], DECODE)
    results, _, _ = drive(engine, [good])
    assert results[good.id].token_ids == engine.generate([good.prompt], DECODE)[0].token_ids


def test_generate_refuses_while_steps_run_rows_and_a_record_owns_its_pages(engine):
    """While a stepped request runs, generate() refuses (it would take its row); the row's record
    holds its KV pages, which are all the pool counts in use and come back when it finishes."""
    request = EngineRequest(prompts(1)[0], DECODE)
    engine.step([request])
    ((_, row),) = engine.rows.items()
    assert row.request is request and len(row.pages) == engine.pages_needed(request.prompt, DECODE)
    assert engine.stats().pages_in_use == len(row.pages)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([request.prompt], DECODE)
    while len(engine.rows):
        assert engine.step().error is None
    assert engine.stats().pages_in_use == 0
    assert len(engine.generate([request.prompt], DECODE)) == 1


def test_warmup_without_a_callback_logs_each_step(caplog):
    """The Python API's warm-up says what it compiles: a log line per step when no progress
    callback is given."""
    import logging

    eng = Engine(tiny_cfg(), tiny_params(), batch_size=1, buffer_size=1, prefill_chunk=16)
    with caplog.at_level(logging.INFO, logger="mbd_jax.engine"):
        eng.warmup()
    said = [r.getMessage() for r in caplog.records if r.name == "mbd_jax.engine"]
    assert any("compiling the decode loop" in m for m in said), said
    assert any("compiling prefill of 16 tokens" in m for m in said) and "warm-up done" in said[-1]
