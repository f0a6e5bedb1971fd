"""An adapter fine-tune (`train_hvd.py --task sft --lora-rank`) under ZeRO, half precision
and `--recompute`, against one process.

The oracle: the same run in one process on the same global batches
(`--global-order`; two ranks of 4 sequences against one of 8), in float32
without recomputation. Its weighted loss over the learned tokens of the
global batch (the examples' completions, of unequal lengths on the two
ranks), its adapters folded into the base and its losses step by step.
Tensor and pipeline layouts have their own adapter tests
(`tests/test_tensor_parallel.py`, `tests/test_pipeline_training.py`).
"""

import numpy as np
import pytest

from tests.launch import REPO, launch_each, train_losses
from tests.test_instruction_data import _examples, _prepare

STEPS = 4
# A Llama-shaped block: RMSNorm, rotary positions, grouped-query attention, a gated MLP.
MODEL = ["--num-layers", "2", "--num-heads", "4", "--hidden-dim", "16", "--intermediate-dim",
         "24", "--max-sequence-length", "16", "--dropout", "0.0", "--norm", "rms",
         "--positions", "rotary", "--num-key-value-heads", "2", "--feedforward", "gated",
         "--activation", "silu", "--no-tie-embeddings"]
RUN = ["--warmup-steps", "0", "--eval-batches", "0", "--log-every", "1", "--learning-rate",
       "0.02", "--global-order", "--no-scale-learning-rate", "--gradient-clip-norm", "0.5"]
ADAPTERS = ["--task", "sft", "--steps", str(STEPS), "--lora-rank", "2", "--lora-targets",
            "query,key_value,output_projection,feedforward_gate,feedforward_output"]
# name: (ranks, flags). Each two-rank run holds 4 sequences a rank.
RUNS = {
    "one": (1, ["--batch-size", "8"]),
    "one-bfloat16": (1, ["--batch-size", "8", "--mixed-precision", "bfloat16"]),
    "one-float16": (1, ["--batch-size", "8", "--mixed-precision", "float16"]),
    "zero1": (2, ["--batch-size", "4", "--zero-stage", "1"]),
    "zero2-recompute": (2, ["--batch-size", "4", "--zero-stage", "2", "--recompute"]),
    "zero3": (2, ["--batch-size", "4", "--zero-stage", "3"]),
    "zero3-bfloat16": (2, ["--batch-size", "4", "--zero-stage", "3", "--mixed-precision",
                           "bfloat16"]),
    "zero1-float16": (2, ["--batch-size", "4", "--zero-stage", "1", "--mixed-precision",
                          "float16"]),
}
# Half precision's rounding unit: the losses agree with float32's to a few of them.
UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@pytest.fixture(scope="module")
def adapter_runs(tiny_data, tmp_path_factory):
    """`{name: out}` of RUNS, and the base run: two launches (one process, two ranks)."""
    from tests.test_instruction_data import _train

    root = tmp_path_factory.mktemp("adapters")
    base = root / "base"
    _train(["--data", str(tiny_data), "--out", str(base), "--steps", "2", *MODEL,
            "--batch-size", "4", "--warmup-steps", "0", "--eval-batches", "0"])
    code, data = _prepare(root, tiny_data, _examples(80))
    assert code == 0
    outs = {name: root / name for name in RUNS}
    for ranks in (1, 2):
        launch_each(REPO / "train_hvd.py", 0 if ranks == 1 else ranks, [
            ["--data", data, "--init", base, "--out", outs[name], *MODEL, *RUN, *ADAPTERS,
             *flags] for name, (count, flags) in RUNS.items() if count == ranks])
    return base, outs


def _folded_logits(out):
    from tfgpt.loading import load_model

    model, _ = load_model(str(out))
    return model(np.arange(24, dtype="int32").reshape(2, 12) % 50).numpy()


@pytest.mark.distributed
@pytest.mark.slow
def test_adapters_under_zero_and_recompute_train_as_one_process(adapter_runs):
    from tfgpt.checkpoint.files import Reader, latest

    base, outs = adapter_runs
    one = train_losses(outs["one"])
    assert sorted(one) == list(range(1, STEPS + 1))
    oracle = _folded_logits(outs["one"])
    assert np.abs(oracle - _folded_logits(base)).max() > 1e-3  # the adapters act
    for name in ("zero1", "zero2-recompute", "zero3"):
        losses = train_losses(outs[name])
        assert sorted(losses) == sorted(one), name
        for step in one:
            assert losses[step] == pytest.approx(one[step], abs=1e-5), (name, step)
        np.testing.assert_allclose(_folded_logits(outs[name]), oracle, rtol=0, atol=1e-5,
                                   err_msg=name)
        # The checkpoint holds the adapters, their moments and the run's
        # position alone (ZeRO shards nothing else) and names the base.
        reader = Reader(latest(str(outs[name])))
        assert reader.index["base"]["checkpoint"] == latest(str(base)), name
        assert sorted(key for key in reader.keys if "adapter_" not in key) == [
            "data_cursor", "optimizer/iteration", "step"], name
        assert {key for key in reader.keys if key.endswith("/momentum")} == {
            key + "/momentum" for key in reader.keys if key.endswith(("adapter_a", "adapter_b"))}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("precision", sorted(UNIT))
def test_adapters_in_half_precision_train_as_float32_does_under_zero(adapter_runs, precision):
    base, outs = adapter_runs
    layout = "zero3-bfloat16" if precision == "bfloat16" else "zero1-float16"
    one, half, sharded = (train_losses(outs[name])
                          for name in ("one", f"one-{precision}", layout))
    assert sorted(half) == sorted(sharded) == sorted(one)
    for step in one:
        # The sharded run's losses are the one process's in the same precision,
        # to its rounding; both are float32's to a few units.
        assert sharded[step] == pytest.approx(half[step], rel=UNIT[precision]), (layout, step)
        assert half[step] == pytest.approx(one[step], rel=8 * UNIT[precision]), step
    # The adapters moved the model as float32's did, to half precision's rounding.
    start, oracle, moved, moved_sharded = (
        _folded_logits(out) for out in (base, outs["one"], outs[f"one-{precision}"],
                                        outs[layout]))
    scale = np.abs(oracle - start).max()
    # Seen: 0.0022 and 0.0025 (bfloat16), 0.00035 and 0.00008 (float16) of a move of 0.38.
    assert np.abs(moved_sharded - moved).max() < 0.02 * scale
    assert np.abs(moved - oracle).max() < 0.02 * scale
