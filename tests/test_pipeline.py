"""Pipeline parallelism (tfgpt.parallel.pipeline_*): the same training as one process.

The multi-process tests run `tests/hvd_scripts/pipeline_check.py` under
`horovodrun -np 2` (each rank one stage of a tiny GPT, the whole global
batch cut into micro-batches) and compare the final weights with one
process trained through `TrainStep` on the same batches (`--global`).
"""


import numpy as np
import pytest

from tests.launch import REPO, held_weights, horovodrun, run_each, saved_weights

SCRIPT = REPO / "tests" / "hvd_scripts" / "pipeline_check.py"


# ---- Layout and partition (no processes) ------------------------------------------


def test_layout_tensor_innermost_then_pipeline_then_data():
    from tfgpt.parallel.state import ParallelState

    layout = ParallelState(size=12, rank=7, pipeline=3, tensor=2)
    assert layout.data == 2
    coordinates = [layout.coordinates(rank) for rank in range(12)]
    assert coordinates == [(d, p, t) for d in range(2) for p in range(3) for t in range(2)]
    assert all(layout.rank_of(*c) == rank for rank, c in enumerate(coordinates))
    assert layout.pipeline_group() == [1, 3, 5] or layout.pipeline_group() == [7, 9, 11]
    assert layout.pipeline_group() == [7, 9, 11] and layout.stage == 0
    assert layout.data_group() == [1, 7]
    # Every rank is in exactly one group of each kind.
    for groups in (layout.pipeline_groups(), layout.data_groups()):
        assert sorted(r for group in groups for r in group) == list(range(12))


def test_layout_refuses_sizes_that_do_not_divide_the_workers():
    from tfgpt.parallel.state import ParallelState

    with pytest.raises(ValueError, match=r"size=3, tensor_parallel=1, pipeline_parallel=2"):
        ParallelState(size=3, pipeline=2)


def test_partitions():
    from tfgpt.parallel.pipeline_partition import partition_blocks

    assert partition_blocks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    # The head costs two blocks: the last stage gets two blocks fewer.
    assert partition_blocks(8, 2, "balanced", block_cost=1.0, last_cost=2.0) == [(0, 5), (5, 8)]
    # Brute force over every cut: balanced reaches the smallest largest stage cost.
    import itertools

    for layers, parts, last in [(6, 3, 1.5), (9, 4, 3.0), (5, 2, 0.5)]:
        def largest(cuts):
            bounds = [0, *cuts, layers]
            return max((bounds[i + 1] - bounds[i]) + (last if i == parts - 1 else 0)
                       for i in range(parts))
        best = min(largest(c) for c in itertools.combinations(range(1, layers), parts - 1))
        ranges = partition_blocks(layers, parts, "balanced", block_cost=1.0, last_cost=last)
        assert largest([start for start, _ in ranges[1:]]) == best
    with pytest.raises(ValueError, match=r"must not exceed the model's --num-layers.*4 stages, "
                                         r"num_layers=3"):
        partition_blocks(3, 4)


def test_stage_variables_cover_the_model_once_but_the_tied_table():
    import keras

    from tfgpt import GPT
    from tfgpt.parallel.pipeline_schedule import PipelineSchedule
    from tfgpt.parallel.pipeline_stage import PipelineStage

    keras.utils.set_random_seed(1)
    model = GPT(vocabulary_size=37, num_layers=5, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=7)
    schedule = PipelineSchedule("interleaved", 2, 2, virtual_stages=2)
    stages = [PipelineStage(model, schedule, rank) for rank in range(2)]
    assert [stage.chunks for stage in stages] == [[0, 2], [1, 3]]
    assert stages[0].ranges == [(0, 2), (2, 3), (3, 4), (4, 5)]
    held = [id(v) for stage in stages for v in stage.trainable_variables]
    table = id(model.embeddings.token_embedding.embeddings)
    assert held.count(table) == 2  # the first stage's and the last stage's copy
    assert sorted(set(held)) == sorted(id(v) for v in model.trainable_variables)
    assert len(held) == len(model.trainable_variables) + 1
    # Under adapters the stages train each adapter once, and the frozen table not at all.
    from tfgpt.models.adapters import adapter_variables, add_adapters

    add_adapters(model, rank=2)
    stages = [PipelineStage(model, schedule, rank) for rank in range(2)]
    held = [id(v) for stage in stages for v in stage.trainable_variables]
    assert sorted(held) == sorted(id(v) for v in adapter_variables(model))
    assert not any(stage.trains_table for stage in stages)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_the_stages_in_turn_give_the_models_weighted_loss_of_packed_rows(positions):
    # Oracle: the whole model's loss with the same segments and weights.
    import keras

    from tfgpt import GPT
    from tfgpt.parallel.pipeline_schedule import PipelineSchedule
    from tfgpt.parallel.pipeline_stage import PipelineStage
    from tfgpt.training.train_step import cross_entropy

    keras.utils.set_random_seed(2)
    model = GPT(vocabulary_size=37, num_layers=3, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=7, dropout=0.0, positions=positions)
    first, last = (PipelineStage(model, PipelineSchedule("1f1b", 2, 2), rank) for rank in (0, 1))
    rng = np.random.default_rng(0)
    inputs, targets = (rng.integers(0, 37, (2, 7)).astype("int32") for _ in range(2))
    segments = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 2, 2, 2, 2, 3]], "int32")
    weights = np.array([[1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 1, 1]], "float32")  # 0: padding
    expected = cross_entropy(targets, model(inputs, segment_ids=segments), weights)
    got = last.forward(1, first.forward(0, inputs, segment_ids=segments), targets, weights,
                       segments)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-6)
    # Without the segments the rows are one example each: another loss.
    unpacked = last.forward(1, first.forward(0, inputs), targets, weights)
    assert abs(float(unpacked) - float(expected)) > 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_of_an_unallocated_model_allocates_its_own_weights_as_one_process_has_them(tied):
    import keras

    from tfgpt import GPT
    from tfgpt.parallel.pipeline_schedule import PipelineSchedule
    from tfgpt.parallel.pipeline_stage import PipelineStage
    from tfgpt.parallel.unallocated import allocated, build_unallocated

    def build():
        keras.utils.set_random_seed(4)
        return GPT(vocabulary_size=37, num_layers=5, num_heads=2, hidden_dim=8,
                   intermediate_dim=12, max_sequence_length=7, dropout=0.1,
                   tie_embeddings=tied)

    reference = build()
    whole = [v.numpy() for v in reference.variables]  # in the order of any copy's
    whole_count = reference.count_params()
    schedule = PipelineSchedule("interleaved", 2, 2, virtual_stages=2)
    for rank in (1, 0):  # the later stage first: the order of allocation does not matter
        model = build_unallocated(build)
        assert not any(allocated(v) for v in model.variables)
        stage = PipelineStage(model, schedule, rank)
        held = [v for v in model.variables if allocated(v)]
        ids = {id(v) for v in held}
        assert ids == {id(v) for v in stage.held_variables}
        # Its chunks' blocks, the embeddings (first) or the final norm and the
        # table (last, tied), with their dropout states; nothing else.
        assert {id(v) for v in stage.trainable_variables} <= ids
        assert (id(model.embeddings.position_embedding.embeddings) in ids) == (rank == 0)
        assert (id(model.final_norm.gamma) in ids) == (rank == 1)
        assert (id(model.embeddings.token_embedding.embeddings) in ids) == (rank == 0 or tied)
        for variable, value in zip(model.variables, whole):
            if allocated(variable):
                np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
        # The whole model's shapes stay known: its parameters count as one process's.
        assert model.count_params() == whole_count


# ---- Equivalence with one process ------------------------------------------------


_weights = saved_weights


def _assert_same_training(results, oracle, what):
    """Each rank holds its stage's weights alone, the ranks all of them
    between them, each as one process trained it."""
    expected = _weights(oracle)
    covered = set()
    for rank, result in enumerate(results):
        got = held_weights(result)
        assert len(got) < len(expected), (what, rank)
        covered |= set(got)
        for index, weight in got.items():
            np.testing.assert_allclose(weight, expected[index], rtol=0, atol=1e-5,
                                       err_msg=f"{what}, rank {rank}, weight {index}")
        np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=1e-5)
    assert covered == set(range(len(expected))), what


CLIP = ["--clip", "0.3"]
SCHEDULES = [("gpipe", []), ("1f1b", []), ("interleaved", ["--virtual-stages", "2"])]
# Untied head, 3 blocks split by FLOPs (the head's 2 V C on the last stage).
UNTIED = ["--untied", "--layers", "3", "--partition", "balanced"]
# M = 1 (fewer micro-batches than stages) and M = 3 (not divisible by P = 2).
COUNTS = [("gpipe", "1"), ("1f1b", "1"), ("gpipe", "3"), ("1f1b", "3")]
DROPOUT = ["--schedule", "1f1b", "--dropout", "0.2"]
FLOAT16 = ["--precision", "float16", "--overflow-step", "2", *CLIP]
# The equivalence runs, one launch per rank count (each launch pays the
# processes' start-up once): tag -> flags.
RUNS = {
    0: {"global": CLIP, "global-bf16": ["--precision", "bfloat16"], "global-untied": UNTIED,
        "global-gptj": ["--family", "gptj", *CLIP], "global-f16": FLOAT16},
    2: {
        **{name: ["--schedule", name, "--microbatches", "4", *extra, *CLIP]
           for name, extra in SCHEDULES},
        # Horovod's alltoall has no bfloat16: the activations and their
        # gradients travel as their uint16 bits, so nothing is rounded twice.
        "bf16": ["--precision", "bfloat16", "--schedule", "1f1b"],
        # float16 loss scaling, the first stage's gradients alone overflowing at step 3.
        "f16": [*FLOAT16, "--schedule", "1f1b"],
        **{f"{name}-{count}": ["--schedule", name, "--microbatches", count, *UNTIED]
           for name, count in COUNTS},
        "dropout-first": DROPOUT,
        # Each block's activations recomputed in the backward pass: the same training.
        "recompute": ["--schedule", "1f1b", "--recompute", *CLIP],
        # GPT-J's shape: the head's bias on the last stage, rotary positions in each.
        "gptj": ["--family", "gptj", "--schedule", "1f1b", *CLIP],
    },
    # 2 data-parallel replicas x 2 stages, each pipeline on half the rows;
    # the stages' gradients averaged over the replicas, clipping by the
    # norm over the whole model.
    4: {"pp2-dp2": ["--stages", "2", "--microbatches", "3", *CLIP]},
}


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """`RUNS`, run: {tag: the ranks' files}."""
    directory = tmp_path_factory.mktemp("pipeline")
    results = {}
    for ranks, runs in RUNS.items():
        results.update(run_each(SCRIPT, directory, ranks, [
            (tag, *flags) for tag, flags in runs.items()]))
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_each_schedule_two_pipelines_recompute_bfloat16_and_gptj_match_one_process(pipeline_runs):
    runs = pipeline_runs
    oracle = runs["global"][0]
    assert oracle["norms"][0] > 0.3  # clipping acts: the norm must be global to match
    for name, _ in SCHEDULES:
        _assert_same_training(runs[name], oracle, name)
    # Micro-batches change where bfloat16 rounds: the losses agree to its precision.
    np.testing.assert_allclose(runs["bf16"][1]["losses"], runs["global-bf16"][0]["losses"],
                               rtol=0, atol=2e-2)
    _assert_same_training(runs["pp2-dp2"], oracle, "2 pipelines of 2 stages")
    _assert_same_training(runs["recompute"], oracle, "1F1B with --recompute")
    _assert_same_training(runs["gptj"], runs["global-gptj"][0], "GPT-J-shaped, 1F1B")


@pytest.mark.distributed
@pytest.mark.slow
def test_float16_overflow_on_the_first_stage_is_skipped_by_every_stage(pipeline_runs):
    oracle, results = pipeline_runs["global-f16"][0], pipeline_runs["f16"]
    # 6 steps, the third skipped: by one process, and by both stages though
    # only the first stage's gradients overflowed.
    assert int(oracle["iterations"]) == 5
    finite = np.isfinite(oracle["norms"])
    assert finite.sum() == 5
    for rank, result in enumerate(results):
        assert int(result["iterations"]) == 5, rank
        np.testing.assert_array_equal(np.isfinite(result["norms"]), finite)
        # Micro-batches change where float16 rounds: its unit roundoff, 2^-11.
        np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=2.0 ** -11)
        np.testing.assert_allclose(result["norms"][finite], oracle["norms"][finite],
                                   rtol=4 * 2.0 ** -11)
        # An AdamW step moves a weight by about the learning rate (0.01)
        # whatever its gradient's size: one near 0 may go either way.
        for index, weight in held_weights(result).items():
            np.testing.assert_allclose(weight, saved_weights(oracle)[index], rtol=0, atol=5e-3,
                                       err_msg=f"rank {rank}, weight {index}")


@pytest.mark.distributed
@pytest.mark.slow
def test_untied_balanced_and_awkward_microbatch_counts(pipeline_runs):
    for name, count in COUNTS:
        _assert_same_training(pipeline_runs[f"{name}-{count}"], pipeline_runs["global-untied"][0],
                              f"{name} M={count}")


@pytest.mark.distributed
@pytest.mark.slow
def test_dropout_gives_the_same_losses_run_to_run(pipeline_runs, tmp_path):
    # Two launches (the fixture's and this one): the masks must not depend
    # on anything but the seeds.
    first = pipeline_runs["dropout-first"]
    runs = run_each(SCRIPT, tmp_path, 2, [("second", *DROPOUT), ("plain", "--schedule", "1f1b")])
    second, plain = runs["second"], runs["plain"]
    np.testing.assert_array_equal(first[0]["losses"], second[0]["losses"])
    for a, b in zip(_weights(first[1]), _weights(second[1])):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(first[0]["losses"], plain[0]["losses"])  # dropout did act


@pytest.mark.distributed
def test_a_peer_that_dies_ends_the_run_with_an_error(tmp_path):
    code, output = horovodrun(2, SCRIPT, tmp_path, "dies", "--die-at-step", "3", timeout=240)
    assert code != 0
    assert not (tmp_path / "dies-rank-0.npz").exists()
