"""The scheduler's admission order (serving/admission_order.py), simulated: rows that free after
each request's decode time, a step every 50 ms offering the queues to an engine that admits what
it is offered. Properties over random arrival streams: under the dynamic order no request that
waited past its limit is overtaken, every request is admitted well within the queue timeout,
and thinking requests are served under a steady normal load that starves them in FIFO order."""

from __future__ import annotations

import collections
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from mbd_jax.config import SchedulerConfig
from mbd_jax.serving.admission_order import length_class, offer

ROWS, STEP_S, QUEUE_TIMEOUT_S, THINKING_ROWS = 4, 0.05, 30.0, 2


@dataclasses.dataclass(eq=False)
class Job:
    prompt: list[int]
    arrived: float
    thinking: bool
    seconds: float  # how long it holds its row
    admitted: float | None = None


def simulate(jobs: list[Job], cfg: SchedulerConfig, until: float = 120.0) -> list[tuple]:
    """Steps until every job was admitted (or `until`); returns (time, job, oldest aged job
    still waiting then) for each admission."""
    waiting: list[Job] = []
    running: list[Job] = []
    pending = sorted(jobs, key=lambda j: j.arrived)
    log = []
    now = 0.0
    patience = min(cfg.max_wait_ms / 1e3, QUEUE_TIMEOUT_S / 2)
    while now < until and (pending or waiting):
        while pending and pending[0].arrived <= now:
            waiting.append(pending.pop(0))
        running = [j for j in running if j.admitted + j.seconds > now]
        normal = [j for j in waiting if not j.thinking]
        thinking = [j for j in waiting if j.thinking]
        room = THINKING_ROWS - sum(j.thinking for j in running)
        offered = offer(normal, thinking, ROWS - len(running), room, cfg, QUEUE_TIMEOUT_S, now)
        for j in offered[: ROWS - len(running)]:  # the engine admits what its free rows hold
            aged = [w for w in waiting if now - w.arrived >= patience and w is not j
                    and w.admitted is None and (not w.thinking or room > 0)]
            j.admitted = now
            waiting.remove(j)
            running.append(j)
            room -= j.thinking
            log.append((now, j, min(aged, key=lambda w: w.arrived) if aged else None))
        now += STEP_S
    return log


@st.composite
def streams(draw) -> list[Job]:
    """Up to 60 requests over 20 s at under the rows' capacity: prompts of 1 to 240 tokens,
    one in eight thinking, each holding its row 0.05 to 1.5 s."""
    n = draw(st.integers(5, 60))
    gaps = draw(st.lists(st.floats(0.0, 0.8), min_size=n, max_size=n))
    jobs, t = [], 0.0
    for gap in gaps:
        t += gap
        jobs.append(Job(prompt=[1] * draw(st.integers(1, 240)), arrived=round(t, 3),
                        thinking=draw(st.booleans()) and draw(st.booleans()) and
                        draw(st.booleans()),
                        seconds=draw(st.floats(0.05, 1.5))))
    return jobs


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(jobs=streams(), max_wait_ms=st.sampled_from([0, 500, 2000]),
       min_segment_len=st.sampled_from([8, 32, 64]))
def test_dynamic_never_overtakes_an_aged_request_and_admits_all_in_time(jobs, max_wait_ms,
                                                                       min_segment_len):
    cfg = SchedulerConfig(type="dynamic", min_segment_len=min_segment_len, max_wait_ms=max_wait_ms)
    log = simulate(jobs, cfg)
    assert all(j.admitted is not None for j in jobs)
    for when, job, oldest_aged in log:
        # an aged request waiting is admitted before any request that arrived after it
        assert oldest_aged is None or oldest_aged.arrived >= job.arrived, (when, job, oldest_aged)
        assert when - job.arrived < QUEUE_TIMEOUT_S


def test_length_classes_merge_short_segments_and_double():
    assert [length_class(n, 32) for n in (1, 31, 32, 33, 64, 65, 128, 129)] == [
        0, 0, 1, 2, 2, 3, 3, 4]


def test_requests_of_the_oldest_ones_length_come_first_until_one_waits_too_long():
    cfg = SchedulerConfig(type="dynamic", min_segment_len=32, max_wait_ms=1000)
    long0, short1, long2, short3 = (Job([1] * n, t, False, 1.0)
                                    for n, t in ((200, 0.0), (5, 0.1), (190, 0.2), (6, 0.3)))
    got = offer([long0, short1, long2, short3], [], 3, 0, cfg, QUEUE_TIMEOUT_S, now=0.5)
    assert got == [long0, long2, short1]  # the oldest one's class, then by age
    got = offer([short1, long2, short3], [], 2, 0, cfg, QUEUE_TIMEOUT_S, now=1.05)
    assert got == [short1, short3]  # short1's class (long2 not yet aged)
    got = offer([short1, long2, short3], [], 2, 0, cfg, QUEUE_TIMEOUT_S, now=1.25)
    assert got == [short1, long2]  # both aged: arrival order first
    fifo = SchedulerConfig(type="fifo")
    queue = collections.deque([long0, short1, long2])  # as the scheduler keeps its queues
    assert offer(queue, collections.deque(), 2, 0, fifo, QUEUE_TIMEOUT_S, 0.5) == [long0, short1]
    assert offer(queue, collections.deque(), 2, 0, cfg, QUEUE_TIMEOUT_S, 0.5) == [long0, long2]


def steady_load_with_thinking() -> list[Job]:
    """Normal requests arriving faster than the rows drain them (20 a second for 8 a second of
    room) for 60 s, and three thinking ones early on."""
    normal = [Job([1] * 20, round(0.05 * i, 3), False, 0.5) for i in range(1200)]
    thinking = [Job([1] * 20, 1.0 + i, True, 0.5) for i in range(3)]
    return normal + thinking


def test_thinking_requests_are_served_under_steady_normal_load():
    dynamic = steady_load_with_thinking()
    simulate(dynamic, SchedulerConfig(type="dynamic", max_wait_ms=2000), until=60.0)
    for t in (j for j in dynamic if j.thinking):
        # admitted in time, and no later than the normal request that arrived next
        after = min((j for j in dynamic if not j.thinking and j.arrived > t.arrived),
                    key=lambda j: j.arrived)
        assert t.admitted - t.arrived < QUEUE_TIMEOUT_S and t.admitted <= after.admitted
    fifo = steady_load_with_thinking()
    simulate(fifo, SchedulerConfig(type="fifo"), until=60.0)
    assert all(j.admitted is None for j in fifo if j.thinking)  # starved for the whole minute
