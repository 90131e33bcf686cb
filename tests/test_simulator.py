"""The schedule replay against closed forms: Alpa's eq. 2, 1F1B's memory, transfers and gradient sync."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.contract import schedules
from autopar.cost_models.simulator import Hosts, StageTimes, simulate, step_floor


def uniform(n, f=1.0, b=2.0, send=0.0, sync=0.0, act=1.0):
    return [StageTimes(forward_s=f, backward_s=b, send_s=send if i < n - 1 else 0.0, grad_sync_s=sync,
                       state_bytes=10.0, activation_bytes=act) for i in range(n)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, micro", [(1, 1), (1, 8), (4, 8), (4, 4), (8, 32), (3, 2)])
def test_uniform_pipeline_matches_alpa_eq2(schedule, stages, micro):
    sim = simulate(uniform(stages), micro, schedule)
    per_stage = 3.0
    assert sim.step_time_s == pytest.approx(stages * per_stage + (micro - 1) * per_stage)  # Σ t_i + (B-1) max t
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe():
    one = simulate(uniform(4), 16, "1f1b")
    gpipe = simulate(uniform(4), 16, "gpipe")
    assert one.peak_memory_bytes == [10 + 4, 10 + 3, 10 + 2, 10 + 1]  # stages - index microbatches
    assert gpipe.peak_memory_bytes == [10 + 16] * 4


def test_slowest_stage_sets_the_pace():
    stages = [StageTimes(1, 2, 0, 0), StageTimes(2, 4, 0, 0)]
    assert simulate(stages, 10).step_time_s == pytest.approx(3 + 6 + 9 * 6)


def test_transfers_and_gradient_sync_add_up():
    base = simulate(uniform(2), 4).step_time_s
    with_send = simulate(uniform(2, send=0.5), 4).step_time_s
    # at least one hop each way on the critical path, at most one per microbatch each way
    assert base + 2 * 0.5 <= with_send <= base + 2 * 4 * 0.5
    synced = simulate(uniform(2, sync=5.0), 4)
    assert synced.step_time_s == pytest.approx(base + 5.0)  # the exposed part, after stage 0's last backward
    assert {e.kind for e in synced.events} == {"F", "B", "send", "sync"}


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 1),
                                              ("interleaved-1f1b", 3), ("interleaved-zb", 2), ("zbv", 2)])
def test_every_schedule_orders_every_action_once(schedule, virtual):
    """Each rank runs every action of each of its stages once; a split backward's parts in order."""
    p, m = 4, 8
    backward = ["I", "W"] if schedules.splits_backward(schedule) else ["B"]
    where = schedules.stage_ranks(schedule, p, virtual)
    for r in range(p):
        order = schedules.order(schedule, p, r, m, virtual)
        expected = [(k, s, i) for s in range(p * virtual) if where[s] == r for k in ["F", *backward] for i in range(m)]
        assert sorted(order) == sorted(expected)
        for s, i in {(s, i) for _, s, i in order}:
            kinds = [k for k, s2, i2 in order if (s2, i2) == (s, i)]
            assert kinds == ["F", *backward]
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.order("zb", 2, 0, 2)


def test_ranks_sharing_cores_slow_each_other_down():
    one = [StageTimes(1.0, 2.0, 0.0, 0.5, optimizer_s=0.5)]
    alone = simulate(one, 1).step_time_s
    assert alone == pytest.approx(4.0)
    # 4 ranks of one stage on 2 cores: everything they do takes twice as long; with a core each, no change
    assert simulate(one, 1, hosts=Hosts((4,), 4, 2)).step_time_s == pytest.approx(8.0)
    assert simulate(one, 1, hosts=Hosts((4,), 4, 4)).step_time_s == pytest.approx(4.0)
    # a pipeline's idle stages leave their cores to the busy ones: between a core each and half a core each
    base = simulate(uniform(4), 8).step_time_s
    shared = simulate(uniform(4), 8, hosts=Hosts((1, 1, 1, 1), 4, 2))
    assert base < shared.step_time_s < 2 * base
    # fill alone: stage 0's first forward has the host to itself, at full speed
    first = next(e for e in shared.events if e.stage == 0 and e.kind == "F")
    assert first.end - first.start == pytest.approx(1.0)
    # two hosts of 2 ranks and 1 core each: a stage per host runs at half speed whatever the other does
    two = simulate(uniform(2), 4, hosts=Hosts((2, 2), 2, 1)).step_time_s
    assert two == pytest.approx(2 * simulate(uniform(2), 4).step_time_s)


_seconds = st.floats(0.0, 4.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(stages=st.lists(st.tuples(_seconds, _seconds, _seconds, _seconds, _seconds), min_size=1, max_size=6),
       micro=st.integers(1, 12), schedule=st.sampled_from(["1f1b", "gpipe"]), shared=st.booleans())
def test_the_step_floor_is_never_above_the_replay(stages, micro, schedule, shared):
    """What lets the planner skip simulating a candidate that cannot beat the best step so far (a deep
    pipeline's replay takes seconds): the floor is below every replay, ranks sharing cores or not."""
    times = [StageTimes(f, b, send, sync, optimizer_s=opt) for f, b, send, sync, opt in stages]
    hosts = Hosts((1,) * len(times), len(times), 1) if shared else None
    assert step_floor(times, micro) <= simulate(times, micro, schedule, hosts).step_time_s * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(stages=st.lists(st.tuples(_seconds, _seconds, _seconds, _seconds, st.floats(0.0, 1.0)), min_size=1, max_size=4),
       micro=st.integers(1, 9), schedule=st.sampled_from(sorted(schedules.SCHEDULES)), virtual=st.sampled_from([1, 2]))
def test_the_one_pass_replay_equals_the_event_replay(stages, micro, schedule, virtual):
    """Without shared cores the replay is one pass over a fixed order of every group's actions (what
    makes planning's thousands of replays cheap); with as many cores as ranks the event-by-event
    replay, which shares cores, runs every action at full speed too: the same steps, peaks, events."""
    times = [StageTimes(f, b, send, sync, optimizer_s=sync / 2, activation_bytes=1.0 + f, transient_bytes=b,
                        grad_bytes=send, state_bytes=5.0, weight_s=w * b) for f, b, send, sync, w in stages] * virtual
    p = len(stages)
    if schedules.problem(schedule, p, micro, virtual):
        return
    one = simulate(times, micro, schedule, None, virtual)
    events = simulate(times, micro, schedule, Hosts((1,) * p, p, p), virtual)
    assert one.step_time_s == pytest.approx(events.step_time_s, rel=1e-12, abs=1e-12)
    assert one.peak_memory_bytes == pytest.approx(events.peak_memory_bytes)
    assert one.bubble_fraction == pytest.approx(events.bubble_fraction, abs=1e-12)
    # the same events at the same times (to rounding: the two replays add the same durations in other orders)
    key = sorted((e.stage, e.kind, e.microbatch, e.start, e.end) for e in one.events)
    other = sorted((e.stage, e.kind, e.microbatch, e.start, e.end) for e in events.events)
    assert [k[:3] for k in key] == [k[:3] for k in other]
    assert [t for k in key for t in k[3:]] == pytest.approx([t for k in other for t in k[3:]], rel=1e-12, abs=1e-9)
