"""The front ends' flags: `--help` explains every one, without TensorFlow.

The oracles are the config dataclasses' fields and the enumerations in
`tfgpt.config`: every field is a flag with a help text and a shown default,
every enumerated field lists exactly its choices, and the flags of one
distribution are not accepted by the other's front ends.
"""

import dataclasses
import difflib
import io
import json
import re
import subprocess
import sys
import types

import pytest

from tests.launch import REPO
from tfgpt.config import (
    ACTIVATIONS,
    FAMILIES,
    MIXED_PRECISION,
    OPTIMIZERS,
    SCHEDULES,
    TrainConfig,
)
from tfgpt.config import TASKS as PRETRAINING_TASKS
from tfgpt.config.distribution import STRATEGIES, HorovodOptions, StrategyOptions
from tfgpt.config.finetuning import TASKS as FINETUNING_TASKS
from tfgpt.config.finetuning import FinetuneConfig
from tfgpt.training.flags import docstring_args

FRONT_ENDS = {
    "train_hvd.py": (TrainConfig, HorovodOptions, ("gpt", "bert", "albert", "roberta")),
    "train_mirrored.py": (TrainConfig, StrategyOptions, ("gpt", "bert", "albert", "roberta")),
    "finetune_hvd.py": (FinetuneConfig, HorovodOptions, ("bert", "albert")),
    "finetune_mirrored.py": (FinetuneConfig, StrategyOptions, ("bert", "albert")),
}
CHOICES = {
    "schedule": SCHEDULES,
    "optimizer": OPTIMIZERS,
    "mixed_precision": MIXED_PRECISION,
    "activation": ACTIVATIONS,
    "strategy": STRATEGIES,
}

# Runs a front end's --help in a fresh interpreter, then reports whether
# TensorFlow was imported on the way.
_HELP_SCRIPT = """
import json, runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "tensorflow": "tensorflow" in sys.modules}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def helps():
    results = {}
    for script in FRONT_ENDS:
        process = subprocess.run(
            [sys.executable, "-c", _HELP_SCRIPT, script], cwd=REPO, capture_output=True,
            text=True, timeout=120,
        )
        status = json.loads(process.stderr.strip().splitlines()[-1])
        results[script] = (process.stdout, status, process.stderr)
    return results


def _entries(help_text):
    """`{flag: (option part, help text)}` of argparse's option listing."""
    entries, current = {}, None
    for line in help_text.splitlines():
        match = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if match:
            options, text = match[1], match[2] or ""
            current = [options, text]
            for flag in re.findall(r"--[\w-]+", options):
                entries[flag] = current
        elif current is not None and line.startswith("      "):
            current[1] += " " + line.strip()
        else:
            current = None
    return {flag: (options, text) for flag, (options, text) in entries.items()}


def _flag(name):
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("script", FRONT_ENDS)
def test_help_imports_no_tensorflow_and_prints_no_log_line(helps, script):
    output, status, stderr = helps[script]
    assert status == {"code": 0, "tensorflow": False}, stderr
    assert stderr.strip().splitlines() == [json.dumps(status)]  # nothing else, no TF line
    assert output.startswith(f"usage: {script}")


@pytest.mark.parametrize("script", FRONT_ENDS)
def test_help_explains_every_flag_and_lists_every_choice(helps, script):
    config_class, options_class, families = FRONT_ENDS[script]
    entries = _entries(helps[script][0])
    run_fields = [f.name for f in dataclasses.fields(config_class)]
    option_fields = [f.name for f in dataclasses.fields(options_class)]
    model_fields = {f.name for family in families
                    for f in dataclasses.fields(FAMILIES[family].config_class)}
    if config_class is FinetuneConfig:
        model_fields.discard("max_sequence_length")  # the input length, a FinetuneConfig field
    expected = {_flag(name) for name in [*run_fields, *option_fields, *model_fields]}
    assert set(entries) - {"--help"} == expected | {
        "--no-" + flag[2:] for flag in expected
        if "--no-" + flag[2:] in entries  # the negative of a boolean flag
    }
    tasks = PRETRAINING_TASKS if config_class is TrainConfig else FINETUNING_TASKS
    for name in [*run_fields, *option_fields, *model_fields]:
        options, text = entries[_flag(name)]
        assert len(text.split()) >= 5, (name, text)  # a sentence, not a bare name
        assert "(default: " in text and "None" not in text, (name, text)
        allowed = tasks if name == "task" else CHOICES.get(name)
        if allowed:
            assert "{" + ",".join(allowed) + "}" in options, (name, options)
    for name in model_fields:
        assert "(default: the preset's value" in entries[_flag(name)][1]
    presets = entries["--preset"][1]
    for preset in config_class.PRESETS:
        assert preset in presets


def test_help_is_the_dataclass_docstring():
    """The help of a flag is its field's `Args:` entry, whitespace joined, type dropped."""
    output = subprocess.run([sys.executable, "finetune_hvd.py", "--help"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    entries = _entries(output)
    assert entries["--steps"][1].startswith("Optimizer steps; 0 derives them from `epochs`.")
    assert entries["--towers"][1].startswith("Slices of each worker's batch whose forward and")
    assert "Must divide `batch_size`." in entries["--towers"][1]
    assert entries["--allreduce-bucket-mb"][1].startswith("Megabytes of gradients per grouped")
    assert entries["--embedding-dim"][1].endswith("ALBERT only. (default: the preset's value, "
                                                  "or --init's)")


def test_docstring_args_reads_every_entry_shape_and_subclasses_override():
    @dataclasses.dataclass
    class Base:
        """Summary.

        Args:
            alpha: int. First line
                and its continuation.
            beta (float): Parenthesised type.
            gamma: tuple of str. A type of several words. Then: more.

        Example:
            alpha: not an entry.
        """

        alpha: int = 1
        beta: float = 2.0
        gamma: tuple = ()

    @dataclasses.dataclass
    class Child(Base):
        """Child.

        Args:
            beta: float. Replaced here.
            delta: str. Only in the child, 50% of it.
        """

        delta: str = ""

    assert docstring_args(Base) == {
        "alpha": "First line and its continuation.",
        "beta": "Parenthesised type.",
        "gamma": "A type of several words. Then: more.",
    }
    assert docstring_args(Child) == {
        "alpha": "First line and its continuation.",
        "beta": "Replaced here.",
        "gamma": "A type of several words. Then: more.",
        "delta": "Only in the child, 50% of it.",
    }


def test_a_field_without_an_args_entry_is_an_error():
    from tfgpt.training.flags import add_config_flags

    @dataclasses.dataclass
    class Undocumented:
        """No entries.

        Args:
            known: int. Documented.
        """

        known: int = 0
        hidden: int = 0

    import argparse

    with pytest.raises(ValueError, match=r"Undocumented.hidden has no `Args:` entry"):
        add_config_flags(argparse.ArgumentParser(), Undocumented)


# ---- Each distribution's own flags ----------------------------------------


def _exit_message(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


REQUIRED = {"train": ["--data", "d"], "finetune": ["--train-file", "t", "--init", "i"]}


@pytest.mark.parametrize("script", ["train_mirrored", "finetune_mirrored"])
@pytest.mark.parametrize(
    "flag", [["--fp16-allreduce"], ["--allreduce-bucket-mb", "0"], ["--zero-stage", "2"],
             ["--tensor-parallel", "2"]]
)
def test_horovod_flags_are_refused_by_the_mirrored_front_ends_naming_theirs(
    script, flag, capsys
):
    argv = [*REQUIRED[script.split("_")[0]], *flag]
    error = _exit_message(__import__(script).main, argv, capsys)
    assert error.strip().splitlines()[-1].endswith(
        f": error: {flag[0]} is a flag of train_hvd.py and finetune_hvd.py "
        "(Horovod, under horovodrun), not of this front end"
    )


@pytest.mark.parametrize("script", ["train_hvd", "finetune_hvd"])
def test_strategy_flags_are_refused_by_the_horovod_front_ends_naming_theirs(script, capsys):
    argv = [*REQUIRED[script.split("_")[0]], "--strategy", "mirrored"]
    error = _exit_message(__import__(script).main, argv, capsys)
    assert ("error: --strategy is a flag of train_mirrored.py and finetune_mirrored.py "
            "(tf.distribute), not of this front end") in error


@pytest.mark.parametrize("script", ["train_hvd", "train_mirrored"])
def test_an_unknown_flag_is_argparses_error(script, capsys):
    error = _exit_message(__import__(script).main, ["--data", "d", "--bogus", "1"], capsys)
    assert "error: unrecognized arguments: --bogus 1" in error


@pytest.mark.parametrize("script, argv, message", [
    ("train_hvd", ["--data", "d", "--allreduce-bucket-mb", "-1"], "allreduce_bucket_mb=-1.0"),
    ("finetune_hvd", ["--train-file", "t", "--init", "i", "--allreduce-bucket-mb", "nan"],
     "allreduce_bucket_mb=nan"),
    ("train_mirrored", ["--data", "d", "--strategy", "ring"],
     "argument --strategy: invalid choice: 'ring'"),
    ("finetune_mirrored", ["--train-file", "t", "--init", "i", "--logical-cpus", "-2"],
     "`logical_cpus` must be a non-negative integer. Received: logical_cpus=-2"),
    ("train_hvd", ["--data", "d", "--zero-stage", "4"],
     "argument --zero-stage: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    ("finetune_hvd", ["--train-file", "t", "--init", "i", "--zero-stage", "-1"],
     "argument --zero-stage: invalid choice: -1"),
])
def test_bad_distribution_flags_exit_with_one_error_line(script, argv, message, capsys):
    error = _exit_message(__import__(script).main, argv, capsys)
    assert message in error and "Traceback" not in error
    assert len([line for line in error.splitlines() if "error:" in line]) == 1


def test_distribution_options_refuse_bad_values():
    with pytest.raises(ValueError, match=r"zero_stage=4"):
        HorovodOptions(zero_stage=4)
    with pytest.raises(ValueError, match=r"allreduce_bucket_mb=-0.5"):
        HorovodOptions(allreduce_bucket_mb=-0.5)
    with pytest.raises(ValueError, match=r"`strategy` must be one of .* strategy='ring'"):
        StrategyOptions(strategy="ring")


# ---- The front ends read alike --------------------------------------------


def _code(script):
    text = (REPO / script).read_text()
    return text[text.index('"""', 3) + 3:].splitlines()  # after the docstring


def _changed_lines(a, b):
    """`(side, index, line)` of the lines of `a` and `b` that differ."""
    changed = []
    for operation, a0, a1, b0, b1 in difflib.SequenceMatcher(a=a, b=b).get_opcodes():
        if operation != "equal":
            changed += [("a", i, a[i]) for i in range(a0, a1)]
            changed += [("b", i, b[i]) for i in range(b0, b1)]
    return changed


@pytest.mark.parametrize("horovod, mirrored", [("train_hvd.py", "train_mirrored.py"),
                                               ("finetune_hvd.py", "finetune_mirrored.py")])
def test_the_two_distributions_front_ends_differ_only_in_tagged_lines(horovod, mirrored):
    """Each differing line is tagged, or is the statement under a tagged comment."""
    code = {"a": _code(horovod), "b": _code(mirrored)}
    tags = {"a": "# Horovod:", "b": "# Distribute:"}
    changed = _changed_lines(code["a"], code["b"])
    assert len(changed) >= 4
    for side, index, line in changed:
        above = code[side][index - 1].strip()
        assert tags[side] in line or (above.startswith(tags[side]) and line.strip()), line


@pytest.mark.parametrize("pretraining, finetuning", [("train_hvd.py", "finetune_hvd.py"),
                                                     ("train_mirrored.py", "finetune_mirrored.py")])
def test_pretraining_and_fine_tuning_front_ends_differ_only_in_their_command(
    pretraining, finetuning
):
    changed = _changed_lines(_code(pretraining), _code(finetuning))
    assert [line for _, _, line in changed] == [
        "from tfgpt.training.front_end import TRAIN as COMMAND",
        "from tfgpt.training.front_end import FINETUNE as COMMAND",
    ]


# ---- The start-up warning of a run that never leaves its warmup -----------


def _start_up_lines(config, steps, is_chief, tmp_path, zero_stage=0, size=1):
    from tfgpt.observe.reporter import Reporter
    from tfgpt.training.loop import start_up_warnings

    stream = io.StringIO()
    report = Reporter(str(tmp_path), is_chief, stream=stream)
    from tfgpt.parallel.state import ParallelState

    distribution = types.SimpleNamespace(state=ParallelState(size, zero_stage=zero_stage),
                                         size=size)
    start_up_warnings(report, config, steps, distribution)
    report.close()
    return stream.getvalue().splitlines()


def test_a_warmup_as_long_as_the_run_is_warned_about_once_on_the_chief(tmp_path):
    config = TrainConfig(data="d", steps=60)  # the default warmup: 100 steps
    lines = _start_up_lines(config, config.steps, True, tmp_path)
    assert lines == [
        "warning: --warmup-steps gives 100 warmup steps for a run of 60: the learning rate "
        "climbs for the whole run, reaches its peak only at the last step and never decays "
        "(cosine); raise --steps or shorten the warmup"
    ]
    assert _start_up_lines(config, config.steps, False, tmp_path) == []
    equal = TrainConfig(data="d", steps=60, warmup_steps=60)
    assert len(_start_up_lines(equal, equal.steps, True, tmp_path)) == 1
    for shorter in (TrainConfig(data="d", steps=60, warmup_steps=59),
                    TrainConfig(data="d", steps=60, warmup_steps=0)):
        assert _start_up_lines(shorter, shorter.steps, True, tmp_path) == []


def test_fine_tuning_warns_on_its_resolved_warmup_steps(tmp_path):
    # warmup = round(fraction x steps), the steps resolved from the data.
    whole = FinetuneConfig(train_file="t.tsv", tokenizer="t", warmup_fraction=1.0)
    (line,) = _start_up_lines(whole, 40, True, tmp_path)
    assert line.startswith("warning: --warmup-fraction gives 40 warmup steps for a run of 40")
    tenth = FinetuneConfig(train_file="t.tsv", tokenizer="t", warmup_fraction=0.1)
    assert _start_up_lines(tenth, 40, True, tmp_path) == []


@pytest.mark.parametrize("size, warned", [(1, True), (2, False)])
def test_a_zero_stage_with_one_worker_is_said_to_shard_nothing(tmp_path, size, warned):
    config = TrainConfig(data="d", steps=200, warmup_steps=10)
    lines = _start_up_lines(config, config.steps, True, tmp_path, zero_stage=2, size=size)
    expected = [
        "warning: --zero-stage 2 with one worker shards nothing: every state stays whole on "
        "it, as with --zero-stage 0, plus a float32 copy of the weights (4 bytes per parameter "
        "more)"
    ]
    assert lines == (expected if warned else [])
