"""train_hvd.py --elastic: a worker lost mid-run and added back, under elastic horovodrun.

Oracles: an uninterrupted run of the same command (the final validation
loss), the global record order read by one pipeline (the sequences the
steps used, each once per epoch), and the checkpoints on disk (they load,
and the last one's data position is what the steps consumed).
"""

import collections
import json
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from pipelines import reader
from pipelines.instruction_data import make_instruction_dataset
from pipelines.manifest import INSTRUCTION_FORMAT
from tests.launch import REPO, checkpoint_tensors, elastic_horovodrun, run
from tests.test_instruction_data import _examples, _prepare
from tests.test_train_hvd import TINY_MODEL
from tfgpt.resilience import faults

STEPS = 200  # 2 workers x 4 sequences: past the end of the 1,281-sequence epoch
KILL_AT = 40  # rank 1 dies as it starts this step
ALONE_FOR = 5  # steps the survivor trains alone before the slot comes back
COMMIT_EVERY = 5
# Rank 0's steps last 0.1 s longer, so that the survivor still trains when
# the slot comes back (after the driver's blacklist cooldown and its next
# look at the discovery script, about 2 s): 20 to 30 steps alone.
SLOW_RANK_0 = "0:0.1"


def elastic_flags(tiny_data, out, *extra):
    return [
        REPO / "train_hvd.py", "--data", tiny_data, "--out", out, "--steps", STEPS,
        "--batch-size", "4", "--learning-rate", "3e-3", "--warmup-steps", "10",
        "--log-every", "10", "--save-every", "50", "--eval-batches", "0",
        "--peak-flops", "1e11", "--monitor-rules", "off", *TINY_MODEL,
        "--elastic", "--commit-every", COMMIT_EVERY, *extra,
    ]


def record_log_lines(directory):
    """`(formation, step, world size, rank, state, fingerprints)` of each
    `faults.RECORD_LOG` line."""
    lines = []
    for path in directory.glob("records-*.txt"):
        for line in path.read_text().splitlines():
            formation, step, size, rank, state, *fingerprints = line.split()
            lines.append((int(formation), int(step), int(size), int(rank), state, fingerprints))
    return lines


def read_record_logs(directory):
    """`{step: (world size, {rank: fingerprints})}` from `faults.RECORD_LOG` files,
    and the number of lines; asserts that every rank of each step logged
    it once, and from one state (the model's weights, bit for bit).

    A step done again after a rollback is logged again by a later
    formation: the last formation's lines are the ones that count.
    """
    lines = collections.defaultdict(list)
    for formation, step, size, rank, state, fingerprints in record_log_lines(directory):
        lines[step].append((formation, size, rank, state, fingerprints))
    steps = {}
    for step, entries in lines.items():
        last = max(entry[0] for entry in entries)
        kept = [entry for entry in entries if entry[0] == last]
        (size,) = {entry[1] for entry in kept}
        assert sorted(entry[2] for entry in kept) == list(range(size)), (step, kept)
        assert len({entry[3] for entry in kept}) == 1, (step, [entry[:4] for entry in kept])
        steps[step] = (size, {entry[2]: entry[4] for entry in kept})
    return steps, sum(len(entries) for entries in lines.values())


def consumed_in_order(steps):
    """The fingerprints the steps used, by position in the global order:
    rank r's i-th sequence of a step of W workers is its position i * W + r."""
    consumed = []
    for step in sorted(steps):
        size, rows = steps[step]
        for position in range(len(rows[0]) * size):
            index, rank = divmod(position, size)
            consumed.append(rows[rank][index])
    return consumed


def record_fingerprints(records, record_length):
    features = {"input_ids": tf.io.FixedLenFeature([record_length], tf.int64)}
    return [
        faults.fingerprint(tf.io.parse_single_example(record, features)["input_ids"].numpy())
        for record in records
    ]


def formations(output):
    """The world size of each formation an elastic run logged, in order."""
    return [int(line.split(", ")[1].split()[0])
            for line in output.splitlines() if "elastic: formation" in line]


def assert_no_abort(output):
    """No worker aborted (Gloo's enforce failures end a worker with status 134)."""
    assert "enforce fail" not in output and "status code 134" not in output, output


def assert_each_sequence_once(steps, data):
    """The steps' sequences, in order, are the global order's from position 0
    (the causal LM's records, or instruction records' tokens); returns them."""
    consumed = consumed_in_order(steps)
    manifest = reader.load_manifest(data)
    if manifest.get("format") == INSTRUCTION_FORMAT:
        rows = make_instruction_dataset(str(data), "train", 1, seed=0, cursor=0)
        expected = [faults.fingerprint(np.concatenate([inputs[0], targets[0, -1:]]))
                    for inputs, targets, _ in rows.take(len(consumed)).as_numpy_iterator()]
    else:
        stream = reader.global_records(manifest, str(data), "train", shuffle=True, seed=0,
                                       shuffle_buffer=reader.DEFAULT_SHUFFLE_BUFFER, cursor=0)
        expected = record_fingerprints(stream.take(len(consumed)), manifest["record_length"])
    assert consumed == expected
    return consumed


def validation_loss(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "val"][-1]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_worker_lost_and_added_back_mid_run(tiny_data, tmp_path):
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    straight.mkdir()
    elastic.mkdir()
    code, output = elastic_horovodrun(straight, *elastic_flags(tiny_data, straight / "run"))
    assert code == 0, output

    records = elastic / "records"

    def world_size(hosts, output):
        failed = re.search(r"blacklist failing host: (\S+)", output)
        alone = [step for _, step, size, _, _, _ in record_log_lines(records) if size == 1]
        if failed and len(hosts.listed) == 2 and not alone:
            hosts.drop(failed.group(1))  # the lost worker's slot is gone
        elif len(hosts.listed) == 1 and alone and max(alone) >= KILL_AT + ALONE_FOR:
            hosts.restore()  # and comes back

    code, output = elastic_horovodrun(
        elastic, *elastic_flags(tiny_data, elastic / "run"), on_poll=world_size,
        env={faults.KILL_AT_STEP: f"1:{KILL_AT}", faults.RECORD_LOG: str(records),
             faults.SLOW_COMPUTE: SLOW_RANK_0},
    )
    assert code == 0, output
    assert "Process 1 exit with status code 137" in output  # SIGKILL
    assert formations(output)[:3] == [2, 1, 2], output
    assert set(formations(output)[2:]) == {2}, output  # the pair, once formed again, stays
    assert_no_abort(output)

    # Each sequence once: the steps' sequences are the global order's, in
    # order, from position 0 (the rolled-back steps, logged twice, count once).
    steps, lines = read_record_logs(records)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert lines > sum(size for size, _ in steps.values())  # some steps were done again
    # The pair formed again trains: the steps after the survivor's are two workers'.
    alone = [step for step, (size, _) in steps.items() if size == 1]
    assert alone and all(steps[step][0] == 2 for step in range(max(alone) + 1, STEPS + 1))
    consumed = assert_each_sequence_once(steps, tiny_data)
    # ... which holds the first epoch whole: every sequence of the split once.
    split = reader.make_dataset(tiny_data, "train", 1, shuffle=False, repeat=False)
    everything = sorted(
        faults.fingerprint(np.concatenate([inputs[0], targets[0, -1:]]))
        for inputs, targets in split.as_numpy_iterator()
    )
    assert len(consumed) > len(everything)
    assert sorted(consumed[: len(everything)]) == everything

    # The final loss is within noise of the uninterrupted run's: the
    # uninterrupted run's final validation loss over seeds 0 to 4 spans
    # 0.538 to 0.664 (0.126; `--seed N` added to `elastic_flags`); the
    # survivor's 20 to 30 steps of half the batch at half the peak rate
    # cost 0.08 here.
    assert validation_loss(elastic / "run") == pytest.approx(validation_loss(straight / "run"),
                                                             abs=0.13)

    # Nothing on disk is corrupted: every kept checkpoint loads whole, and
    # the last one holds the step and the data position the steps reached.
    kept = sorted(elastic.glob("run/ckpt-*"), key=lambda path: int(path.name.split("-")[1]))
    assert [path.name for path in kept] == ["ckpt-100", "ckpt-150", "ckpt-200"]
    saved = [checkpoint_tensors(path) for path in kept]
    assert saved[-1]["step"] == STEPS
    assert saved[-1]["data_cursor"] == len(consumed)
    json.loads((elastic / "run" / "config.json").read_text())


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_added_train_from_the_same_state(tiny_data, tmp_path):
    """1 -> 2 -> 4 workers on this machine, at gpt-mini's width, in one
    launch: the workers that join train, every step of every rank from
    the same weights (`read_record_logs`), without an abort (Horovod's
    response cache, kept by the first worker across the re-formation,
    aborted such a pair) or a hang (the two workers started beside others
    run one tower where the first two run two, and named their gradient
    buckets otherwise: `tfgpt.parallel.horovod_bridge`); each sequence of
    the global order is used once. The run fine-tunes (`--task sft`, on
    instruction records) `--lora-rank 4` adapters on a frozen `--init`
    base: the adapters too are every rank's alike at every step, its
    checkpoints hold them alone, and the base stays the init's, bit for
    bit."""
    from dataclasses import asdict

    from pipelines.tokenizer import Tokenizer
    from tfgpt import GPT
    from tfgpt.checkpoint.files import Reader, latest
    from tfgpt.config import GPTConfig
    from tfgpt.loading import save_model
    from tfgpt.models.adapters import (
        adapted_layers,
        adapter_variables,
        add_run_adapters,
        base_keys,
        load_adapters,
    )

    steps, enough = 32, 4
    records = tmp_path / "records"
    width = ["--hidden-dim", "384", "--num-heads", "6", "--intermediate-dim", "1536"]
    base_config = GPTConfig(vocabulary_size=reader.load_manifest(str(tiny_data))["tokenizer"][
        "vocabulary_size"], num_layers=2, num_heads=6, hidden_dim=384, intermediate_dim=1536,
        max_sequence_length=16)
    base = GPT(**asdict(base_config))
    save_model(tmp_path / "base", base, Tokenizer.load(str(tiny_data / "tokenizer.model")))
    code, instructions = _prepare(tmp_path, tiny_data, _examples(400))
    assert code == 0

    def steps_at(size):
        return {step for _, step, world, _, _, _ in record_log_lines(records) if world == size}

    # The steps go on while the driver notices the new slots (its next look
    # at the discovery script) and until the next commit: in six runs here
    # the first worker trained 6 to 10 steps alone, the pair 4 to 8.
    def grow(hosts, output):
        workers = sum(hosts.slots.values())
        if workers == 1 and len(steps_at(1)) >= enough:
            hosts.set({"localhost": 1, "127.0.0.1": 1})
        elif workers == 2 and len(steps_at(2)) >= enough:
            hosts.set({"localhost": 2, "127.0.0.1": 2})

    code, output = elastic_horovodrun(
        tmp_path, *elastic_flags(instructions, tmp_path / "run", "--steps", steps,
                                 "--commit-every", "2", "--log-every", "5", *width, "--init",
                                 tmp_path / "base", "--task", "sft", "--lora-rank", "4"),
        on_poll=grow, slots={"localhost": 1}, max_slots=4,
        env={faults.RECORD_LOG: str(records), faults.SLOW_COMPUTE: "0:0.2"})
    assert code == 0, output
    assert formations(output) == [1, 2, 4], output
    assert_no_abort(output)
    steps_logged, _ = read_record_logs(records)
    assert sorted(steps_logged) == list(range(1, steps + 1))
    sizes = [steps_logged[step][0] for step in sorted(steps_logged)]
    assert sizes == sorted(sizes) and sizes[-1] == 4, sizes
    assert sizes.count(2) >= enough and sizes.count(4) >= enough, sizes
    assert_each_sequence_once(steps_logged, instructions)

    # The checkpoint holds the adapters alone and names the base; read back onto it,
    # the base weights are the init's, bit for bit, and the adapters trained.
    run_config = json.loads((tmp_path / "run" / "config.json").read_text())
    adapted = GPT(**asdict(base_config))
    add_run_adapters(adapted, run_config["train"])
    load_adapters(str(tmp_path / "run"), adapted)
    checkpoint = Reader(latest(str(tmp_path / "run")))
    assert checkpoint.index["base"]["run"] == str(tmp_path / "base")
    assert not set(checkpoint.keys) & base_keys(adapted)
    adapters = {id(variable) for variable in adapter_variables(adapted)}
    assert len(adapters) == 2 * 2 * 2  # A and B of 2 projections (the defaults) in 2 blocks
    for mine, theirs in zip([v for v in adapted.weights if id(v) not in adapters], base.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=mine.path)
    assert all(np.abs(layer.adapter_b.numpy()).max() > 0 for layer in adapted_layers(adapted))


@pytest.mark.parametrize("flags, message", [
    (["--zero-stage", "2"], "--elastic cannot re-shard --zero-stage 2 state when workers "
                            "come and go: use --zero-stage 0 with --elastic"),
    (["--tensor-parallel", "2"], "--elastic cannot re-split --tensor-parallel 2 slices when "
                                 "workers come and go: use --tensor-parallel 1 with --elastic"),
])
def test_elastic_refuses_sharded_layouts_in_one_line(tmp_path, flags, message):
    code, output = run([sys.executable, REPO / "train_hvd.py", "--data", tmp_path,
                        "--elastic", *flags])
    assert code == 2
    assert output.strip().splitlines()[-1] == f"train_hvd.py: error: {message}"


def test_commit_every_must_be_positive():
    from tfgpt.config.distribution import HorovodOptions

    with pytest.raises(ValueError, match="`commit_every` must be a positive integer. "
                                         "Received: commit_every=0"):
        HorovodOptions(elastic=True, commit_every=0)


def _train_with_options(argv, options):
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    distribution = LocalDistribution()
    distribution.options = options
    return train(train_config, overrides, distribution)


@pytest.mark.parametrize("flags, message", [
    (["--preset", "bert-demo", "--task", "mlm"],
     r"--elastic reads a decoder's records \(--task clm or sft\) in one global order; --task "
     "mlm is not supported"),
    (["--skip-corrupt"], "--skip-corrupt would leave out different shards on different workers"),
])
def test_elastic_refuses_what_breaks_the_global_order(tiny_data, tmp_path, flags, message):
    from tfgpt.config.distribution import HorovodOptions

    with pytest.raises(ValueError, match=message):
        _train_with_options(["--data", str(tiny_data), "--out", str(tmp_path / "run"),
                             "--steps", "2", *flags], HorovodOptions(elastic=True))


def test_fine_tuning_refuses_elastic(tmp_path):
    from tfgpt.config.distribution import HorovodOptions
    from tfgpt.finetuning.finetuner import finetune
    from tfgpt.finetuning.flags import parse_flags
    from tfgpt.parallel import LocalDistribution

    config, overrides = parse_flags(["--task", "classification", "--init", str(tmp_path / "init"),
                                     "--train-file", str(tmp_path / "train.tsv")])
    distribution = LocalDistribution()
    distribution.options = HorovodOptions(elastic=True)
    with pytest.raises(ValueError, match=r"--elastic is for pretraining \(train_hvd.py\): "
                                         "fine-tuning runs on a fixed set of workers"):
        finetune(config, overrides, distribution)


def test_elastic_resume_refuses_a_run_trained_without_it(tiny_data, tmp_path):
    from tfgpt.config.distribution import HorovodOptions

    flags = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--steps", "2",
             "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e10", *TINY_MODEL]
    _train_with_options(flags, HorovodOptions())
    with pytest.raises(ValueError, match=r"ckpt-2 was written without --elastic or --global-order "
                                         r"and has no "
                                         r"position in the global record order"):
        _train_with_options([*flags, "--steps", "4", "--resume"],
                            HorovodOptions(elastic=True))

