"""Pipeline schedules (tfgpt.parallel.pipeline_schedule): the diagrams of the
papers, dependency order, in-flight micro-batches and the bubble against theory."""

import doctest

import pytest

from tfgpt.parallel import pipeline_schedule
from tfgpt.parallel.pipeline_schedule import BACKWARD, FORWARD, PipelineSchedule

# Every schedule over a range of sizes, including M = 1, M < P and M not
# divisible by P (interleaved refuses the last two: see below).
SIZES = [(name, stages, microbatches, virtual)
         for name, virtuals in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3)))
         for stages in (2, 3, 4)
         for microbatches in (1, 2, 3, 4, 5, 8, 12)
         for virtual in virtuals
         if name != "interleaved" or microbatches % stages == 0]


def _ticks(schedule):
    """`(tick, [(rank, operation, virtual stage) of the ranks busy in it])`, tick by tick."""
    for tick in range(schedule.ticks):
        yield tick, [(rank, operation, schedule.virtual_stage(rank, operation.chunk))
                     for rank, operation in enumerate(row[tick] for row in schedule.timetable)
                     if operation is not None]


def test_docstring_example():
    assert doctest.testmod(pipeline_schedule).failed == 0


def test_gpipe_diagram():
    # Huang et al. 2019, figure 2(c): all forward passes, then all backward.
    assert str(PipelineSchedule("gpipe", stages=3, microbatches=4)) == "\n".join([
        "rank 0 | F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3",
        "rank 1 | .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .",
        "rank 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .",
    ])


def test_1f1b_diagram():
    # Narayanan et al. 2021, figure 4 (top): 4 stages, 8 micro-batches;
    # rank r warms up with 4 - r - 1 forward passes, then alternates.
    rows = str(PipelineSchedule("1f1b", stages=4, microbatches=8)).splitlines()
    assert rows[0] == "rank 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7"
    assert rows[3] == "rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  ."


def test_interleaved_program_order():
    # Narayanan et al. 2021, figure 4 (bottom), 2 chunks: micro-batches in
    # groups of `stages`, through chunk 0 then chunk 1 forward; backward from
    # the last chunk.
    schedule = PipelineSchedule("interleaved", stages=2, microbatches=4, virtual_stages=2)
    program = [f"{op.kind[0].upper()}{op.microbatch}/{op.chunk}" for op in schedule.programs[1]]
    assert program[:4] == ["F0/0", "F1/0", "F0/1", "B0/1"]
    forwards = [text for text in program if text[0] == "F"]
    assert forwards == ["F0/0", "F1/0", "F0/1", "F1/1", "F2/0", "F3/0", "F2/1", "F3/1"]
    backwards = [text for text in program if text[0] == "B"]
    assert backwards == ["B0/1", "B1/1", "B0/0", "B1/0", "B2/1", "B3/1", "B2/0", "B3/0"]


@pytest.mark.parametrize("name, stages, microbatches, virtual", SIZES)
def test_dependencies_and_bubble(name, stages, microbatches, virtual):
    schedule = PipelineSchedule(name, stages, microbatches, virtual)
    finished = {}  # (kind, microbatch, virtual stage) -> tick
    for tick, busy in _ticks(schedule):
        for _, operation, stage in busy:
            key = (operation.kind, operation.microbatch, stage)
            assert key not in finished
            if operation.kind == FORWARD and stage > 0:
                # The previous stage's activation came in an earlier tick's exchange.
                assert finished[(FORWARD, operation.microbatch, stage - 1)] < tick
            if operation.kind == BACKWARD:
                assert finished[(FORWARD, operation.microbatch, stage)] < tick
                if stage < schedule.num_virtual_stages - 1:
                    assert finished[(BACKWARD, operation.microbatch, stage + 1)] < tick
            finished[key] = tick
    # Every micro-batch went forward and backward through every virtual stage once.
    assert len(finished) == 2 * microbatches * schedule.num_virtual_stages
    for rank in range(stages):
        assert schedule.bubble(rank) == pytest.approx((stages - 1) / (microbatches * virtual))
        assert schedule.bubble(rank) == pytest.approx(schedule.theoretical_bubble())


@pytest.mark.parametrize("name, stages, microbatches, virtual", SIZES)
def test_transfers_match_the_timetable(name, stages, microbatches, virtual):
    schedule = PipelineSchedule(name, stages, microbatches, virtual)
    for tick, transfers in enumerate(schedule.transfers):
        # One tensor at most from each rank after a tick: its operation's output.
        assert len({transfer.source for transfer in transfers}) == len(transfers)
        for transfer in transfers:
            operation = schedule.timetable[transfer.source][tick]
            stage = schedule.virtual_stage(transfer.source, operation.chunk)
            step = 1 if operation.kind == FORWARD else -1
            assert transfer.virtual_stage == stage + step
            assert transfer.destination == schedule.rank_of(stage + step)
            assert (transfer.kind, transfer.microbatch) == (operation.kind, operation.microbatch)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 8, 12])
def test_1f1b_holds_at_most_stages_microbatches_gpipe_all(stages, microbatches):
    gpipe = PipelineSchedule("gpipe", stages, microbatches)
    one_f_one_b = PipelineSchedule("1f1b", stages, microbatches)
    for rank in range(stages):
        assert gpipe.in_flight(rank) == microbatches
        assert one_f_one_b.in_flight(rank) == min(stages - rank, microbatches)


@pytest.mark.parametrize(
    "args, message",
    [
        (("pipedream", 2, 4, 1), "`pipeline_schedule` must be one of"),
        (("1f1b", 2, 0, 1), "`microbatches` must be a positive integer"),
        (("interleaved", 2, 4, 1), "needs --virtual-stages of at least 2"),
        (("interleaved", 2, 3, 2), "--microbatches must be divisible by it.*microbatches=3"),
        (("interleaved", 4, 2, 2), "microbatches=2, pipeline_parallel=4"),
        (("interleaved", 2, 1, 2), "microbatches=1, pipeline_parallel=2"),
        (("gpipe", 2, 4, 2), "--virtual-stages is for --pipeline-schedule interleaved"),
    ],
)
def test_refusals(args, message):
    with pytest.raises(ValueError, match=message):
        PipelineSchedule(*args)


@pytest.mark.parametrize("name, stages, microbatches, virtual", SIZES)
def test_every_send_meets_its_receive_and_is_used_once(name, stages, microbatches, virtual):
    # The executor's protocol, replayed without processes: every rank calls
    # one exchange per tick with transfers (so all ranks call the same
    # collectives in the same order), files what it receives, and each
    # operation takes its input from what it received; nothing is left over.
    schedule = PipelineSchedule(name, stages, microbatches, virtual)
    assert all(len(row) == schedule.ticks for row in schedule.timetable)
    received = [set() for _ in range(stages)]
    for tick, busy in _ticks(schedule):
        for rank, operation, stage in busy:
            needs = ((FORWARD, stage > 0) if operation.kind == FORWARD
                     else (BACKWARD, stage < schedule.num_virtual_stages - 1))
            if needs[1]:
                key = (operation.kind, operation.microbatch, stage)
                assert key in received[rank], (tick, rank, key)
                received[rank].remove(key)
            produced = stage + (1 if operation.kind == FORWARD else -1)
            sent = [t for t in schedule.transfers[tick] if t.source == rank]
            if 0 <= produced < schedule.num_virtual_stages:
                assert [(t.kind, t.microbatch, t.virtual_stage) for t in sent] == [
                    (operation.kind, operation.microbatch, produced)]
            else:
                assert sent == []  # the first stage's gradient, the last stage's loss
        for transfer in schedule.transfers[tick]:
            key = (transfer.kind, transfer.microbatch, transfer.virtual_stage)
            assert key not in received[transfer.destination]
            received[transfer.destination].add(key)
    assert received == [set() for _ in range(stages)]
