"""bench.memory's ZeRO arithmetic: a GPT's parameter count and largest gathered
unit without building it, the deepest GPT that fits a memory budget, and one
real horovodrun job of gpt-mini at stages 0 and 3."""

import dataclasses
import json
import subprocess
import sys

import pytest

from bench.memory import budget_depth, gpt_parameters
from tests.launch import REPO
from tests.test_gpt import GPT2_PARAMETERS
from tfgpt.config import GPT_PRESETS, GPTConfig
from tfgpt.parallel.zero import state_bytes

GIB = 2**30


@pytest.mark.parametrize("preset", sorted(GPT2_PARAMETERS))
def test_parameters_of_the_presets_are_the_published_counts(preset):
    parameters, _ = gpt_parameters(GPT_PRESETS[preset])
    assert parameters == GPT2_PARAMETERS[preset]


@pytest.mark.parametrize(
    "vocabulary_size, tie_embeddings, norm_first",
    # 37 words: a block (532) outweighs the tables; 97 words: the tables do.
    [(37, True, True), (37, False, False), (97, True, True), (97, False, True)],
)
def test_parameters_and_largest_unit_equal_a_built_model(vocabulary_size, tie_embeddings,
                                                         norm_first):
    from tfgpt import GPT

    config = GPTConfig(vocabulary_size=vocabulary_size, num_layers=3, num_heads=2, hidden_dim=8,
                       intermediate_dim=12, max_sequence_length=5,
                       tie_embeddings=tie_embeddings, norm_first=norm_first)
    model = GPT(**dataclasses.asdict(config))
    count = lambda variables: sum(int(v.numpy().size) for v in variables)  # noqa: E731
    blocks = [count(block.trainable_variables) for block in model.blocks]
    # ZeroSharding's units: each block's variables, and everything else.
    rest = count(model.trainable_variables) - sum(blocks)
    assert gpt_parameters(dataclasses.asdict(config)) == (
        count(model.trainable_variables), max(*blocks, rest)
    )


def test_budget_depth_stage_0_by_hand():
    # GPT-2 small: a block has 12 C^2 + 13 C = 7,087,872 parameters, the
    # tables and final norm (50,257 + 1,024) C + 2 C = 39,385,344; stage 0
    # keeps 16 bytes of each. 2 GiB less 0.5 GiB of overhead, less the
    # tables' 630,165,504 bytes, leaves 980,447,232 bytes: 8.65 blocks of
    # 113,405,952.
    fields = GPT_PRESETS["gpt2-small"]
    depth = budget_depth(fields, 0, 1, 2 * GIB, GIB // 2)
    assert depth == {"num_layers": 8, "parameters": 8 * 7_087_872 + 39_385_344,
                     "total": 16 * (8 * 7_087_872 + 39_385_344)}
    # The budget is inclusive: exactly 8 blocks' bytes fit, one byte less does not.
    exact = GIB // 2 + depth["total"]
    assert budget_depth(fields, 0, 1, exact, GIB // 2)["num_layers"] == 8
    assert budget_depth(fields, 0, 1, exact - 1, GIB // 2)["num_layers"] == 7


def test_budget_depth_stage_3_by_hand():
    # GPT-2 medium over 2 ranks at stage 3: 16 bytes per parameter of the
    # larger half, plus 8 bytes (weights and gradients) per parameter of the
    # largest unit, the tables: 52,513,792 > a block's 12,596,224. 3.5 GiB
    # less 420,110,336 bytes gathered leaves 3,337,986,048 = 16 x
    # 208,624,128: P <= 417,248,256, so 364,734,464 / 12,596,224 = 28.96 blocks.
    depth = budget_depth(GPT_PRESETS["gpt2-medium"], 3, 2, 4 * GIB, GIB // 2)
    parameters = 28 * 12_596_224 + 52_513_792
    assert depth == {"num_layers": 28, "parameters": parameters,
                     "total": 16 * (parameters // 2) + 8 * 52_513_792}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("workers", [1, 3])
def test_budget_depth_is_the_last_depth_a_linear_search_accepts(stage, workers):
    fields = GPT_PRESETS["gpt-mini"]
    budget, overhead = 3 * GIB // 4, 600 * 2**20

    def total(layers):
        parameters, unit = gpt_parameters({**fields, "num_layers": layers})
        return state_bytes(parameters, stage, workers, gathered=unit)["total"]

    layers = 0
    while overhead + total(layers + 1) <= budget:
        layers += 1
    depth = budget_depth(fields, stage, workers, budget, overhead)
    assert layers > 1 and depth["num_layers"] == layers
    assert depth["total"] == total(layers)


def test_budget_depth_is_zero_when_not_one_block_fits():
    depth = budget_depth(GPT_PRESETS["gpt2-medium"], 0, 2, GIB, GIB // 2)
    assert depth["num_layers"] == 0


@pytest.mark.parametrize(
    "arguments, message",
    [((4, 2, GIB, 0), "`stage` must be one of"),
     ((3, 0, GIB, 0), "`workers` must be a positive int. Received: workers=0"),
     ((3, 2, 0, 0), "`budget_bytes` must be positive"),
     ((3, 2, GIB, -1), "`overhead_bytes` must be non-negative")],
)
def test_budget_depth_rejects(arguments, message):
    with pytest.raises(ValueError, match=message):
        budget_depth(GPT_PRESETS["gpt-mini"], *arguments)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_rank_job_reports_each_stage_state_and_its_steps(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--presets", "gpt-mini", "--zero-stage", "0", "3",
         "--workers", "2", "--steps", "2", "--sequence-length", "16", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["stage"]: row for row in
            json.loads((tmp_path / "memory-zero.json").read_text())["rows"]}
    parameters, unit = gpt_parameters(GPT_PRESETS["gpt-mini"])
    for stage, row in rows.items():
        # The ranks' model is the preset's, and the state is the arithmetic's.
        assert row["parameters"] == parameters
        assert row["computed"] == state_bytes(parameters, stage, 2,
                                              gathered=unit if stage == 3 else 0)
        assert len(row["ranks"]) == 2
        for rank in row["ranks"]:
            assert len(rank["steps"]) == 2
            for step in rank["steps"]:
                assert step["peak_above_entry_kib"] >= 0
                # The job's peak covers every step's.
                assert rank["high_water_kib"] >= step["rss_after_kib"]
            assert rank["high_water_kib"] >= rank["rss_before_step_kib"] >= rank["runtime_rss_kib"]
    assert rows[3]["largest_unit"] == unit
    assert "| gpt-mini |       2 |     3 |" in result.stdout
    assert result.stdout.count("per step, the largest rank's peak above") == 2
