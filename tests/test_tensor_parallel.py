"""Tensor parallelism: the rank layout, Megatron's operators, and training equal to one process.

The multi-process tests run scripts of `tests/hvd_scripts` under
`horovodrun`: `tensor_parallel_check.py` (the operators against unsplit
autodiff and NumPy) and `tensor_parallel_train.py` (a tiny GPT trained
with its blocks split over a tensor group, against one process on the
same global batches).
"""

import itertools

import numpy as np
import pytest

from tests.launch import REPO, horovodrun, run_and_load, run_each
from tfgpt.parallel.state import ParallelState

OPERATORS_SCRIPT = REPO / "tests" / "hvd_scripts" / "tensor_parallel_check.py"


# ---- The layout (no processes) ---------------------------------------------------


@pytest.mark.parametrize("size, tensor, pipeline",
                         [(8, 2, 2), (6, 3, 1), (4, 1, 2), (2, 2, 1), (3, 1, 1)])
def test_layout_numbers_ranks_tensor_innermost(size, tensor, pipeline):
    layout = ParallelState(size, tensor=tensor, pipeline=pipeline)
    assert layout.data == size // (tensor * pipeline)
    # Split: some rank does not hold the whole model (its data group is not every rank).
    assert layout.split == (layout.data < size)
    # Every rank once, at the coordinates of the nested loops data > pipeline > tensor.
    expected = list(itertools.product(range(layout.data), range(pipeline), range(tensor)))
    assert [layout.coordinates(rank) for rank in range(size)] == expected
    for rank in range(size):
        assert layout.rank_of(*layout.coordinates(rank)) == rank
        group = layout.tensor_group(rank)
        assert group == list(range(group[0], group[0] + tensor))  # consecutive
        assert rank in group and rank in layout.data_group(rank)
        # A data group holds one rank of each replica, at the same stage and slice.
        assert [layout.coordinates(r)[0] for r in layout.data_group(rank)] == list(
            range(layout.data))
        assert {layout.coordinates(r)[1:] for r in layout.data_group(rank)} == {
            layout.coordinates(rank)[1:]}
    # The groups of each kind partition the ranks.
    for groups in (layout.tensor_groups(), layout.data_groups()):
        assert sorted(r for g in groups for r in g) == list(range(size))


def test_layout_of_four_ranks_two_way_tensor_parallel():
    layout = ParallelState(4, tensor=2)
    assert layout.tensor_groups() == [[0, 1], [2, 3]]
    assert layout.data_groups() == [[0, 2], [1, 3]]
    line = layout.describe()
    assert "data 2 x pipeline 1 x tensor 2" in line
    assert "rank 3: data replica 1, tensor slice 2/2" in line


@pytest.mark.parametrize("size, tensor, pipeline", [(3, 2, 1), (4, 3, 1), (6, 2, 2)])
def test_layout_refuses_sizes_that_do_not_multiply_to_the_ranks(size, tensor, pipeline):
    with pytest.raises(ValueError, match=rf"does not divide the {size} rank\(s\) of horovodrun "
                                         rf"-np {size}.*tensor_parallel={tensor}"):
        ParallelState(size, tensor=tensor, pipeline=pipeline)


@pytest.mark.parametrize("tensor", [0, -2, 1.5])
def test_layout_refuses_a_tensor_size_that_is_not_a_positive_integer(tensor):
    with pytest.raises(ValueError, match="`tensor_parallel` must be a positive integer"):
        ParallelState(4, tensor=tensor)


def test_split_rows_refuses_a_size_that_does_not_divide():
    from tfgpt.parallel.tensor_parallel import split_rows

    assert split_rows(12, 3, 2) == (8, 4)
    with pytest.raises(ValueError, match=r"--tensor-parallel 2 must divide `num_heads`. "
                                         r"Received: num_heads=3"):
        split_rows(3, 2, 0, "num_heads")


# Per block, then for the model: the weights Megatron's layout cuts, by the end of their path.
_ATTENTION_FUSED = ["query_key_value/kernel", "query_key_value/bias", "output_projection/kernel"]
_MLP = ["feedforward_intermediate/kernel", "feedforward_intermediate/bias",
        "feedforward_output/kernel"]
SPLIT_BY_PRESET = {
    "gpt-demo": (_ATTENTION_FUSED + _MLP, ["token_embedding/embeddings"]),
    # Grouped-query attention, a gated MLP, no biases, an untied head.
    "llama-demo": (["query/kernel", "key_value/kernel", "output_projection/kernel",
                    "feedforward_gate/kernel", "feedforward_intermediate/kernel",
                    "feedforward_output/kernel"],
                   ["token_embedding/embeddings", "lm_head/kernel"]),
    # No attention biases; an untied head with a bias.
    "gptj-demo": (["query_key_value/kernel", "output_projection/kernel"] + _MLP,
                  ["token_embedding/embeddings", "lm_head/kernel", "lm_head/bias"]),
}


@pytest.mark.parametrize("preset", sorted(SPLIT_BY_PRESET))
def test_split_rules_by_path_cut_what_the_layers_build_in_slices(preset):
    # The rules `split_rules` reads from the variables' paths (what ZeRO and the checkpoint
    # use) are those the layers were built by: each split variable's slices are the
    # take_slice of the whole model built from the same seed, every other variable is
    # whole, and the split ones are those Megatron's layout cuts. (That the layout computes
    # the whole model's function: the multi-process tests below.) No processes: building a
    # slice needs no collective.
    import keras

    from tfgpt import GPT
    from tfgpt.parallel.tensor_parallel import TensorSlice, slice_scope, split_rules, take_slice

    def build(tensor_slice=None):
        keras.utils.set_random_seed(5)
        with slice_scope(tensor_slice):
            return GPT.from_preset(preset, num_layers=2, hidden_dim=16, num_heads=4,
                                   intermediate_dim=24, vocabulary_size=34,
                                   max_sequence_length=8, rotary_fraction=0.5)  # 2 of 4

    whole = build()
    assert split_rules(whole) == {}
    slices = [build(TensorSlice(None, None, 2, index)) for index in range(2)]
    rules = split_rules(slices[0])
    split_names = []
    for index, variable in enumerate(whole.variables):
        parts = [part.variables[index] for part in slices]
        # The same path but for the model's own name (gpt_1, gpt_2, ...).
        assert {part.path.split("/", 1)[1] for part in parts} == {variable.path.split("/", 1)[1]}
        rule = rules.get(id(parts[0]))
        if rule is None:
            for part in parts:
                np.testing.assert_array_equal(part.numpy(), variable.numpy(), err_msg=part.path)
            continue
        split_names.append("/".join(variable.path.split("/")[-2:]))
        for slice_index, part in enumerate(parts):
            np.testing.assert_array_equal(
                part.numpy(), take_slice(variable.numpy(), rule, 2, slice_index),
                err_msg=part.path)
    per_block, model_wide = SPLIT_BY_PRESET[preset]
    assert sorted(split_names) == sorted(2 * per_block + model_wide)


# ---- The operators against unsplit autodiff (horovodrun -np 2) -----------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_operators_match_unsplit_autodiff_and_numpy(tmp_path):
    code, output = horovodrun(2, OPERATORS_SCRIPT, tmp_path)
    assert code == 0, output
    for rank in range(2):
        results = np.load(tmp_path / f"operators-rank-{rank}.npz")
        names = sorted(key[:-len("_got")] for key in results if key.endswith("_got"))
        assert names == sorted([
            "mlp_output", "mlp_input_gradient", "mlp_first_gradient", "mlp_second_gradient",
            "mlp_bias_gradient", "embedding", "cross_entropy", "table_gradient",
            "hidden_gradient",
        ])
        for name in names:
            got, expected = results[f"{name}_got"], results[f"{name}_expected"]
            assert got.shape == expected.shape, name
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5,
                                       err_msg=f"{name}, rank {rank}")


# ---- Training: the same weights as one process (horovodrun -np 2 and 4) ---------------

TRAIN_SCRIPT = REPO / "tests" / "hvd_scripts" / "tensor_parallel_train.py"


def _train(tmp_path, tag, ranks, *flags):
    return run_and_load(TRAIN_SCRIPT, tmp_path, tag, ranks, *flags)


def _count(result):
    return len([key for key in result if key.startswith("weight_")])


def _assert_slices_join_to(results, tensor, oracle, atol):
    """Each tensor group's slices join into the oracle's weights; replicas agree exactly."""
    from tfgpt.parallel.tensor_parallel import join_slices

    assert _count(results[0]) == _count(oracle)
    for first in range(0, len(results), tensor):
        group = results[first:first + tensor]
        for index in range(_count(oracle)):
            name = f"weight_{index}"
            if f"rule_{index}" in group[0]:
                whole = join_slices([r[name] for r in group], tuple(group[0][f"rule_{index}"]))
            else:
                whole = group[0][name]
                for other in group[1:]:  # replicated: identical on every rank of the group
                    np.testing.assert_array_equal(other[name], whole, err_msg=name)
            np.testing.assert_allclose(whole, oracle[name], rtol=0, atol=atol,
                                       err_msg=f"{name}, ranks {first}-{first + tensor - 1}")


CASES = {
    "tp2-clip": (2, ["--clip", "0.5"]),  # TP2: the clipping needs the global gradient norm
    "tp2-untied": (2, ["--untied"]),  # a vocabulary-parallel lm_head of its own
    # GPT-J's shape: rotary, a parallel residual, a split head bias, no attention biases.
    "tp2-gptj": (2, ["--gptj"]),
    "tp2-dp2-clip": (4, ["--clip", "0.5"]),  # TP2 x DP2: gradients averaged over the data groups
    # The blocks recomputed in the backward pass, their collectives with them.
    "tp2-recompute": (2, ["--clip", "0.5", "--recompute"]),
}


# Low-rank adapters on a frozen model (every projection, rank 2), split as their kernels.
LORA_CASES = {
    "tp2-lora": (2, ["--lora", "2", "--clip", "0.5"]),
    # Grouped-query attention (query, key_value) and a gated MLP.
    "tp2-lora-llama": (2, ["--lora", "2", "--llama"]),
    # TP2 x DP2, ZeRO-1 sharding the adapters' optimizer state over the data groups.
    "tp2-dp2-lora-zero1": (4, ["--lora", "2", "--clip", "0.5", "--zero-stage", "1"]),
}
LORA_ORACLES = {"tp2-lora": "one-lora", "tp2-lora-llama": "one-lora-llama",
                "tp2-dp2-lora-zero1": "one-lora"}

# GPT-J's shape unsplit: data parallel, and ZeRO stage 3, on 2 ranks.
GPTJ_DATA = {"dp2-gptj": ["--gptj", "--tensor", "1"],
             "zero3-gptj": ["--gptj", "--tensor", "1", "--zero-stage", "3"]}


# float16 with loss scaling and clipping; at step 3 the first rank's slice
# of a kernel alone overflows.
FLOAT16 = ["--overflow-step", "2", "--clip", "0.5"]


# Packed instruction rows (`prepare --pack`'s: several examples to a row, `segment_ids`)
# under --task sft's loss, 3 steps; (ranks, tensor, flags), 0 ranks: one process.
PACKED = ["--packed", "--steps", "3"]
PACKED_CASES = {
    "towers2-packed": (0, 1, ["--towers", "2"]),  # data parallel over towers in one process
    "tp2-packed": (2, 2, []),
    "zero3-towers2-packed": (2, 1, ["--zero-stage", "3", "--towers", "2"]),
}


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory):
    """The one-process oracles, `CASES` and the first dropout run: one
    launch per rank count (each pays the processes' start-up once).
    Returns {tag: the ranks' files}."""
    directory = tmp_path_factory.mktemp("tensor")
    runs = run_each(TRAIN_SCRIPT, directory, 0, [("one-clip", "--clip", "0.5"),
                                                 ("one-untied", "--untied"),
                                                 ("one-gptj", "--gptj"),
                                                 ("one-lora", "--lora", "2", "--clip", "0.5"),
                                                 ("one-lora-llama", "--lora", "2", "--llama"),
                                                 ("one-float16", *FLOAT16),
                                                 ("one-packed", *PACKED),
                                                 *[(tag, *PACKED, *flags)
                                                   for tag, (size, _, flags)
                                                   in PACKED_CASES.items() if size == 0]])
    for ranks in (2, 4):
        runs.update(run_each(TRAIN_SCRIPT, directory, ranks, [
            *[(tag, "--tensor", "2", *flags)
              for tag, (size, flags) in {**CASES, **LORA_CASES}.items() if size == ranks],
            *([("dropout-first", "--dropout", "0.2")] if ranks == 2 else []),
            *([(tag, *flags) for tag, flags in GPTJ_DATA.items()] if ranks == 2 else []),
            *([("tp2-float16", "--tensor", "2", *FLOAT16)] if ranks == 2 else []),
            *[(tag, *PACKED, "--tensor", tensor, *flags)
              for tag, (size, tensor, flags) in PACKED_CASES.items() if size == ranks]]))
    return runs


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_training_matches_one_process(tensor_runs):
    cases, oracles, runs = CASES, tensor_runs, tensor_runs
    for tag, (ranks, flags) in cases.items():
        oracle = oracles[{"--untied": "one-untied", "--gptj": "one-gptj"}.get(
            flags[0], "one-clip")][0]
        results = runs[tag]
        assert len(results) == ranks
        # Split: per block the heads' projections in and out (3 variables, 2
        # without attention biases), the MLP's (3); the token embedding, and
        # an untied lm_head (with GPT-J's bias, 2).
        split = len([key for key in results[0] if key.startswith("rule_")])
        assert split == {"--untied": 2 * 6 + 2, "--gptj": 2 * 5 + 3}.get(flags[0], 2 * 6 + 1), tag
        for result in results:
            np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5,
                                       err_msg=tag)
            np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=0, atol=1e-5,
                                       err_msg=tag)
        assert not np.allclose(oracle["losses"][0], oracle["losses"][-1])  # it trained
        _assert_slices_join_to(results, 2, oracle, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_adapters_train_as_one_process(tensor_runs):
    # Only the adapters train; under TP2 each block's B of the column-parallel
    # projections and A of the row-parallel ones are split (by their kernel's rule),
    # the other matrix replicated, and they join into the one process's adapters.
    for tag, (ranks, flags) in LORA_CASES.items():
        oracle, results = tensor_runs[LORA_ORACLES[tag]][0], tensor_runs[tag]
        assert len(results) == ranks
        # Per block: q/k/v (fused: 1, grouped: 2), the output projection, the MLP's
        # first (gated: 2) and second; A and B each, one of the two split.
        projections = 6 if "--llama" in flags else 4
        assert _count(oracle) == 2 * 2 * projections, tag
        split = sorted(key for key in results[0] if key.startswith("rule_"))
        assert len(split) == 2 * projections, tag
        for result in results:
            np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5,
                                       err_msg=tag)
            # The replicated matrix's gradient is a sum of the slices' partial products,
            # in another order than one process's: the first step's norm agrees to 1e-6
            # relative, and Adam's steps on the adapters' small gradients carry it to
            # 4e-5 to 1.2e-4 by the sixth, as the threads order the sums (Llama's shape;
            # the losses and weights stay within 1e-5). A gradient left unsummed over the
            # group is off by 0.38 in the norm.
            np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=1e-3, atol=0,
                                       err_msg=tag)
            np.testing.assert_allclose(result["norms"][0], oracle["norms"][0], rtol=1e-5,
                                       err_msg=tag)
        assert not np.allclose(oracle["losses"][0], oracle["losses"][-1])  # it trained
        _assert_slices_join_to(results, 2, oracle, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_gptj_shape_under_data_parallelism_and_zero_3_matches_one_process(tensor_runs):
    oracle = tensor_runs["one-gptj"][0]
    for tag in GPTJ_DATA:
        results = tensor_runs[tag]
        assert len(results) == 2
        for rank, result in enumerate(results):
            for key in ("losses", "norms"):
                np.testing.assert_allclose(result[key], oracle[key], rtol=0, atol=1e-5,
                                           err_msg=f"{tag}, rank {rank}")
            assert _count(result) == _count(oracle)
            for index in range(_count(oracle)):
                np.testing.assert_allclose(result[f"weight_{index}"], oracle[f"weight_{index}"],
                                           rtol=0, atol=1e-5, err_msg=f"{tag}, rank {rank}")


@pytest.mark.distributed
@pytest.mark.slow
def test_packed_sft_batches_under_tensor_parallel_zero_3_and_towers_match_one_process(
        tensor_runs):
    # Each example attends within itself, its positions from 0, and the loss is the mean
    # over the global batch's learned tokens: a rank that dropped the segment ids, or a
    # tower or replica that averaged its own mean, would part from the one process.
    oracle = tensor_runs["one-packed"][0]
    assert len(oracle["losses"]) == 3
    assert not np.allclose(oracle["losses"][0], oracle["losses"][-1])  # it trained
    for tag, (ranks, tensor, _) in PACKED_CASES.items():
        results = tensor_runs[tag]
        assert len(results) == max(ranks, 1)
        for rank, result in enumerate(results):
            for key in ("losses", "norms"):
                np.testing.assert_allclose(result[key], oracle[key], rtol=0, atol=1e-5,
                                           err_msg=f"{tag}, rank {rank}")
        _assert_slices_join_to(results, tensor, oracle, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_dropout_is_deterministic_and_equal_where_replicated(tensor_runs,
                                                                            tmp_path):
    # Two launches (the fixture's and this one).
    first = tensor_runs["dropout-first"]
    second = _train(tmp_path, "second", 2, "--dropout", "0.2")
    np.testing.assert_array_equal(first[0]["losses"], second[0]["losses"])
    np.testing.assert_array_equal(first[1]["losses"], second[1]["losses"])
    # Replicated regions drew the same masks: their parameters stayed equal
    # on both ranks after 6 steps (asserted inside); the split regions (the
    # attention probabilities) drew from their own seeds.
    for index in range(_count(first[0])):
        if f"rule_{index}" not in first[0]:
            np.testing.assert_array_equal(first[0][f"weight_{index}"], first[1][f"weight_{index}"])
    split = first[0]["split_seeds"]
    assert split.sum() == 2  # one per block
    seeds_differ = (first[0]["seeds"] != first[1]["seeds"]).any(axis=1)
    np.testing.assert_array_equal(seeds_differ, split)


# ---- An adapter run of train_hvd.py under TP2: checkpoints, resume, loading --------------


@pytest.mark.distributed
@pytest.mark.slow
def test_a_tp2_adapter_run_checkpoints_resumes_and_loads_as_one_process(tiny_data, tmp_path):
    # Oracle: the same adapter run (--init, --lora-rank) in one process. Under TP2 its
    # checkpoints hold the adapters' slices alone and name the base, a one-process
    # resume of them continues with its losses, and tfgpt.loading folds them into
    # the base as the one process's run folds its own.
    import shutil

    from tests.launch import launch_each, train_losses
    from tfgpt.checkpoint.files import Reader, latest
    from tfgpt.loading import load_model

    model = ["--num-layers", "2", "--num-heads", "4", "--hidden-dim", "16",
             "--intermediate-dim", "24", "--max-sequence-length", "16", "--dropout", "0.0",
             "--norm", "rms", "--positions", "rotary", "--num-key-value-heads", "2",
             "--feedforward", "gated", "--activation", "silu", "--no-tie-embeddings"]
    common = ["--data", tiny_data, "--batch-size", "4", "--log-every", "1", "--eval-batches",
              "0", "--warmup-steps", "0", "--learning-rate", "0.02", "--global-order",
              "--no-scale-learning-rate"]
    base = tmp_path / "base"
    adapters = ["--init", base, "--steps", "4", "--save-every", "2", "--keep-checkpoints", "2",
                "--lora-rank", "2", "--lora-targets", "query,key_value,output_projection,"
                "feedforward_gate,feedforward_intermediate,feedforward_output"]
    launch_each(REPO / "train_hvd.py", 0, [
        [*common, *model, "--out", base, "--steps", "2"],
        [*common, *adapters, "--out", tmp_path / "one"]])
    launch_each(REPO / "train_hvd.py", 2, [
        [*common, *adapters, "--out", tmp_path / "tp2", "--tensor-parallel", "2"]])
    one, tp2 = train_losses(tmp_path / "one"), train_losses(tmp_path / "tp2")
    assert sorted(one) == sorted(tp2) == [1, 2, 3, 4]
    for step in one:
        assert tp2[step] == pytest.approx(one[step], abs=1e-5), step

    reader = Reader(latest(str(tmp_path / "tp2")))
    assert reader.index["base"]["checkpoint"] == latest(str(base))
    assert not [key for key in reader.keys if key.endswith(("/kernel", "/bias", "/gamma"))]
    split = {key: entry for key, entry in reader.keys.items() if key.endswith("adapter_b")
             and "query" in key}
    assert split and all(len(entry["chunks"]) == 2 for entry in split.values())  # 2 slices

    resumed = tmp_path / "tp2-on-one"
    shutil.copytree(tmp_path / "tp2", resumed)
    shutil.rmtree(resumed / "ckpt-4")
    (resumed / "metrics.jsonl").unlink()
    launch_each(REPO / "train_hvd.py", 0, [[*common, *adapters, "--out", resumed, "--resume"]])
    again = train_losses(resumed)
    assert sorted(again) == [3, 4]
    for step in again:
        assert again[step] == pytest.approx(tp2[step], abs=1e-5), step

    ids = np.arange(12, dtype="int32").reshape(2, 6) % 50
    folded = {run: load_model(str(tmp_path / run))[0](ids).numpy() for run in ("one", "tp2")}
    np.testing.assert_allclose(folded["tp2"], folded["one"], rtol=0, atol=1e-5)
    plain, _ = load_model(str(base))
    assert np.abs(folded["one"] - plain(ids).numpy()).max() > 1e-3  # the adapters act


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_float16_skips_an_overflow_in_one_slice_on_every_rank(tensor_runs):
    oracle, results = tensor_runs["one-float16"][0], tensor_runs["tp2-float16"]
    # 6 steps, the third skipped: by one process, and by both ranks though
    # only the first rank's gradients overflowed.
    assert int(oracle["iterations"]) == 5
    for result in results:
        assert int(result["iterations"]) == 5
        assert np.isinf(result["losses"][2])
        finite = np.isfinite(oracle["losses"])
        np.testing.assert_allclose(result["losses"][finite], oracle["losses"][finite],
                                   rtol=2.0 ** -11)
    assert oracle["norms"][0] > 0.5  # clipping acts: by the norm over both slices
    # Replicated weights bitwise equal on both ranks; the slices joined as one
    # process trained the model, to float16's rounding: an AdamW step moves a
    # weight by about the learning rate (0.01) whatever its gradient's size, so
    # one whose gradient is near 0 may go either way (2.2e-3 seen here, so 5e-3).
    _assert_slices_join_to(results, 2, oracle, atol=5e-3)
