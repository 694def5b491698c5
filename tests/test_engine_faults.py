"""A failure inside the engine thread fails only the requests it touched, the engine recovers
(allocating fresh device buffers when the failed call took them), and only repeated failures
stop it for good, which the server is told about. Real engine, real scheduler thread; the
failures are real ones: a decode config that skipped validation overflows int32 on its way to
the device, and a KV buffer whose memory is gone (what a call that fails after taking its
donated buffers leaves behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import jax
import pytest

from mbd_jax.config import DecodeConfig, ServeConfig, ServerConfig
from mbd_jax.engine import Engine
from mbd_jax.serving.metrics import Metrics
from mbd_jax.serving.request import Request
from mbd_jax.serving.refusals import EngineDown
from mbd_jax.serving.scheduler import Scheduler
from tests.conftest import tiny_cfg, tiny_params

GOOD = DecodeConfig(buffer_size=2, max_new_tokens=24)
LONG = DecodeConfig(buffer_size=1, max_new_tokens=400, policy="fixed_steps", steps_per_block=8)
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def engine():
    e = Engine(tiny_cfg(), tiny_params(), batch_size=2, buffer_size=2, prefill_chunk=32)
    e.reference = e.generate([PROMPT], GOOD)[0].token_ids
    return e


def scheduler(engine, max_engine_failures=3) -> Scheduler:
    cfg = ServeConfig(model="tiny-test", decoding=DecodeConfig(buffer_size=2),
                      server=dataclasses.replace(ServerConfig(), max_batch_size=2, buffer_size=2,
                                                 steps_per_call=4,
                                                 max_engine_failures=max_engine_failures))
    engine.reset_buffers()
    s = Scheduler(engine, cfg, Metrics())
    s.start()
    return s


def slow_scheduler(engine, cfg: ServeConfig, monkeypatch) -> Scheduler:
    """A started scheduler over `engine` whose every step sleeps 50 ms first, so a deadline
    passes however fast the machine decodes (a lower bound: nothing depends on slow decoding)."""
    engine.reset_buffers()
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.05)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow_step)
    s = Scheduler(engine, cfg, Metrics())
    s.start()
    return s


async def run(s: Scheduler, decode: DecodeConfig, prompt=PROMPT) -> Request:
    r = Request(id="t", prompt=list(prompt), decode=decode, loop=asyncio.get_running_loop())
    s.submit([r])
    return r


async def outcome(r: Request, timeout=120.0):
    """("done", token ids) or ("error", status)."""
    while True:
        event = await asyncio.wait_for(r.events.get(), timeout)
        if event[0] == "done":
            return "done", event[1].token_ids
        if event[0] == "error":
            return "error", event[1]


async def keep_losing_kv(engine):
    """Deletes the engine's current KV buffer until cancelled: a deletion that lands on buffers a
    running call already took does nothing, so keep at it until one lands between calls."""
    while True:
        for leaf in jax.tree.leaves(engine.kv):
            if not leaf.is_deleted():
                leaf.delete()
        await asyncio.sleep(0.01)


async def until_ready(s: Scheduler):
    while not s.ready:
        await asyncio.sleep(0.05)


def test_a_request_that_breaks_admission_fails_alone(engine):
    """An unvalidated max_nfe of 2^40 raises on its way to the device (int32); the request gets
    a 500, a request already decoding finishes untouched, and the next one is served. Such
    failures never count towards giving up (max_engine_failures 1 here)."""
    s = scheduler(engine, max_engine_failures=1)

    async def main():
        await until_ready(s)
        running = await run(s, LONG)
        first = await asyncio.wait_for(running.events.get(), 60)  # it is decoding
        assert first[0] == "tokens"
        bad = await run(s, DecodeConfig(buffer_size=2, max_nfe=2**40))  # skipped validation
        bad_outcome = await outcome(bad)
        for _ in range(3):  # more of them, on an engine that gives up after one decode failure
            assert await outcome(await run(s, DecodeConfig(max_post_edit_steps=2**40))) == (
                "error", 500)
        running_outcome = await outcome(running)
        after = await outcome(await run(s, GOOD))
        return bad_outcome, running_outcome, after

    try:
        bad, running, after = asyncio.run(main())
        assert bad == ("error", 500)
        assert running[0] == "done" and len(running[1]) == 400
        assert after == ("done", engine.reference)
        assert s.error is None and s.metrics.engine_failures._value.get() == 4
    finally:
        s.stop()


def test_lost_device_buffers_are_reallocated_and_serving_goes_on(engine):
    s = scheduler(engine)

    async def main():
        await until_ready(s)
        running = await run(s, LONG)
        assert (await asyncio.wait_for(running.events.get(), 60))[0] == "tokens"
        loser = asyncio.create_task(keep_losing_kv(engine))  # the KV buffer's memory is gone
        failed = await outcome(running)
        loser.cancel()
        after = await outcome(await run(s, GOOD))
        if after == ("error", 500):  # the last deletion hit the fresh buffers: they recover too
            after = await outcome(await run(s, GOOD))
        return failed, after

    try:
        failed, after = asyncio.run(main())
        assert failed == ("error", 500)
        assert after == ("done", engine.reference)  # exact output on the fresh buffers
        assert s.error is None and s.metrics.engine_failures._value.get() >= 1
    finally:
        s.stop()


def test_repeated_failures_stop_the_engine_and_tell_the_server(engine):
    s = scheduler(engine, max_engine_failures=1)
    told = []
    s.on_fatal = lambda: told.append(True)

    async def main():
        await until_ready(s)
        running = await run(s, LONG)
        assert (await asyncio.wait_for(running.events.get(), 60))[0] == "tokens"
        loser = asyncio.create_task(keep_losing_kv(engine))
        try:
            return await outcome(running)
        finally:
            loser.cancel()

    try:
        assert asyncio.run(main()) == ("error", 503)
        s._thread.join(timeout=30)  # the engine thread ends after telling the server
        assert s.error is not None and told == [True]

        async def refused():
            with pytest.raises(EngineDown):
                await run(s, GOOD)

        asyncio.run(refused())
    finally:
        s.stop()


def test_deadlines_end_a_long_request_and_a_queued_one(engine, monkeypatch):
    """Both rows: two long requests exceed generation_timeout_ms (504) while a third, queued
    behind them, exceeds queue_timeout_ms (503); the next request is served. Every engine step is
    held back by a sleep first, so both deadlines pass however fast the machine decodes (a
    sleep is a lower bound: the test never depends on the decode being slow)."""
    cfg = ServeConfig(model="tiny-test", decoding=DecodeConfig(buffer_size=2),
                      server=dataclasses.replace(ServerConfig(), max_batch_size=2, buffer_size=2,
                                                 steps_per_call=4, queue_timeout_ms=1000,
                                                 generation_timeout_ms=2500))
    step = engine.step
    s = slow_scheduler(engine, cfg, monkeypatch)

    async def main():
        await until_ready(s)
        # 400 tokens one per forward at 4 forwards per step: 100 steps, >= 5 s of sleeps, past
        # the 2.5 s budget; submitted together to an idle engine, both are admitted at its next
        # step, long before their 1 s in the queue is up
        loop = asyncio.get_running_loop()
        first, second = (Request(id=f"long{i}", prompt=list(PROMPT), decode=LONG, loop=loop)
                         for i in range(2))
        s.submit([first, second])
        third = await run(s, GOOD)  # no row frees before 2.5 s: it waits past its 1 s
        return [await last_event(r) for r in (first, second, third)]

    async def last_event(r: Request):
        while (event := await asyncio.wait_for(r.events.get(), 120))[0] == "tokens":
            pass
        return event

    try:
        first, second, third = asyncio.run(main())
        assert first[:2] == second[:2] == ("error", 504) and "time budget" in first[2]
        # waiting too long for a row is overload (the HTTP side adds Retry-After), not a timeout
        assert third[:2] == ("error", 503) and "queue_timeout_ms" in third[2]
        monkeypatch.setattr(engine, "step", step)

        async def after():
            return await outcome(await run(s, GOOD))

        assert asyncio.run(after()) == ("done", engine.reference)
    finally:
        s.stop()


def test_thinking_requests_keep_to_their_row_cap_and_time_budget(engine, monkeypatch):
    """generation.thinking_max_rows 1 with both rows free: of two long thinking requests the
    second starts only once the first has ended, each at its thinking_timeout_ms (504), while a
    normal request beside them is served (the cap is the thinking requests' alone). Every step
    sleeps first, so the budget passes however fast the machine decodes."""
    cfg = ServeConfig(model="tiny-test", decoding=DecodeConfig(buffer_size=2),
                      generation=dataclasses.replace(ServeConfig().generation, thinking_max_rows=1,
                                                     thinking_timeout_ms=1500),
                      server=dataclasses.replace(ServerConfig(), max_batch_size=2, buffer_size=2,
                                                 steps_per_call=4))
    s = slow_scheduler(engine, cfg, monkeypatch)

    async def main():
        await until_ready(s)
        loop = asyncio.get_running_loop()
        thinking = [Request(id=f"think{i}", prompt=list(PROMPT), decode=LONG, loop=loop,
                            thinking=True) for i in range(2)]
        s.submit(thinking)
        normal = await run(s, GOOD)
        times = {}

        async def watch(r: Request):
            while True:
                event = await asyncio.wait_for(r.events.get(), 120)
                times.setdefault((r.id, "first"), time.monotonic())
                if event[0] != "tokens":
                    times[(r.id, "end")] = time.monotonic()
                    return event

        ends = await asyncio.gather(*(watch(r) for r in thinking), outcome(normal))
        return ends, times

    try:
        (first, second, normal), times = asyncio.run(main())
        assert first[:2] == second[:2] == ("error", 504) and "time budget (2 s)" in first[2]
        assert times[("think1", "first")] >= times[("think0", "end")]  # one thinking row at a time
        assert normal == ("done", engine.reference)
    finally:
        s.stop()
