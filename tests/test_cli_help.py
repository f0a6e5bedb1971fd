"""Every command's `--help`: each flag explained, enumerated flags list their
choices, and no TensorFlow imported (so no TensorFlow log line either)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO
from tfgpt.config import GPT_PRESETS

# Runs a module as `python -m` does and reports, after its --help, every
# argument its parsers declared and whether TensorFlow was imported.
WRAPPER = """
import argparse, json, runpy, sys
declared = []
add_argument = argparse._ActionsContainer.add_argument
def recording(self, *args, **kwargs):
    action = add_argument(self, *args, **kwargs)
    declared.append({"flag": action.option_strings[-1] if action.option_strings else action.dest,
                     "help": action.help, "choices": list(action.choices or [])})
    return action
argparse._ActionsContainer.add_argument = recording
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
else:
    code = None
print("@@" + json.dumps({"code": code, "tensorflow": "tensorflow" in sys.modules,
                         "declared": declared}))
"""

PRESETS = list(GPT_PRESETS)
# (module, arguments before --help, {flag: its choices}).
COMMANDS = [
    ("tfgpt.generate", [], {}),
    ("tfgpt.convert", [], {}),
    ("tfgpt.convert", ["to-tfgpt"], {}),
    ("tfgpt.convert", ["to-gpt2"], {}),
    ("tfgpt.convert", ["merge"], {}),
    ("tfgpt.convert", ["to-peft"], {}),
    ("tfgpt.export", [], {}),
    ("tfgpt.report", [], {}),
    ("tfgpt.slurm_launcher", [], {}),
    ("tfgpt.kernels.build", [], {}),
    ("bench.run", [], {"--sections": ["training", "scaling", "memory", "generation",
                                      "pipeline"]}),
    ("bench.generation", [], {"--preset": PRESETS}),
    ("bench.memory", [], {"--presets": PRESETS, "--zero-stage": [0, 1, 2, 3]}),
    ("bench.memory", ["worker"], {"--preset": PRESETS}),
    ("bench.pipeline", [], {}),
    ("bench.lora_memory", [], {}),
    ("bench.fault_times", [], {"--cases": ["data-horovod-stopped", "data-shared-memory-stopped",
                                           "pipeline-stopped", "tensor-stopped", "zero3-hung",
                                           "zero3-stopped"]}),
    ("bench.profile_summary", [], {}),
    ("bench.scaling", [], {"--preset": PRESETS,
                           "--kinds": ["horovod", "multi-worker", "independent"],
                           "--zero-stages": [0, 1, 2, 3]}),
    ("bench.throughput", [], {"--preset": PRESETS, "--configs": None}),
    ("bench.throughput", ["worker"], {"--framework": ["tf", "torch", "peak"],
                                      "--precision": ["fp32", "bf16"], "--preset": PRESETS}),
    # `tfgpt SUBCOMMAND` runs the front end of each (tfgpt/__main__.py).
    ("tfgpt", ["prepare"], {}),
    ("tfgpt", ["train"], {}),
    ("tfgpt", ["train", "--strategy", "mirrored"],
     {"--strategy": ["default", "one-device", "mirrored", "multi-worker"]}),
    ("tfgpt", ["finetune"], {}),
    ("tfgpt", ["checkpoint"], {}),
]


def _help(module, arguments):
    environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    environment["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, module, *arguments, "--help"],
        capture_output=True, text=True, cwd=REPO, env=environment, timeout=120,
    )
    text, _, report = result.stdout.rpartition("@@")
    assert report, result.stdout + result.stderr
    return text, result.stderr, json.loads(report)


@pytest.mark.parametrize(
    "module, arguments, enumerated", COMMANDS,
    ids=[" ".join([module, *arguments]) for module, arguments, _ in COMMANDS],
)
def test_help_explains_every_flag_without_tensorflow(module, arguments, enumerated):
    text, errors, report = _help(module, arguments)
    assert report["code"] == 0, (text, errors)
    assert not report["tensorflow"], f"{module} --help imported TensorFlow"
    assert errors == "", errors
    declared = {entry["flag"]: entry for entry in report["declared"]}
    # A subcommand's help lists its own flags, each at the start of a line; its
    # siblings' are declared too (argparse builds every subparser), and their choices
    # and defaults are shown in their own help.
    shown = {flag for flag in declared if not flag.startswith("--")
             or re.search(rf"^ +([^ ,]+( [^ ,]+)?, )*{re.escape(flag)}\b", text, re.MULTILINE)}
    for flag, entry in declared.items():
        if flag == "--help":
            continue
        assert entry["help"], f"{module}: {flag} has no help text"
        for choice in entry["choices"] if flag in shown else []:
            assert str(choice) in text, f"{module}: {flag}'s choice {choice!r} is not listed"
    for flag, choices in enumerated.items():
        assert flag in declared, f"{module}: no {flag}"
        assert declared[flag]["choices"], f"{module}: {flag} takes any value"
        if choices is not None:
            assert declared[flag]["choices"] == choices, (flag, declared[flag]["choices"])
    # Defaults are shown (tfgpt.cli.HelpFormatter).
    if any(flag.startswith("--") and flag != "--help" for flag in shown):
        assert "(default: " in text, text


def test_convert_help_lists_its_subcommands():
    text, _, report = _help("tfgpt.convert", [])
    assert report["code"] == 0 and not report["tensorflow"]
    listed = text.split("positional arguments:")[1]
    assert all(name in listed for name in ("to-tfgpt", "to-gpt2", "merge", "to-peft")), text


def test_tfgpt_lists_its_subcommands_and_runs_each_front_end():
    from tfgpt.__main__ import STRATEGY_FRONT_ENDS, SUBCOMMANDS, module_of

    text, _, report = _help("tfgpt", [])
    assert report["code"] == 0 and not report["tensorflow"], text
    listed = text.split("subcommands:")[1].split()
    assert all(name in listed for name in SUBCOMMANDS), text
    # train and finetune: the Horovod front end, or with --strategy the tf.distribute one.
    assert module_of("train", ["--data", "d"]) == "train_hvd"
    assert module_of("train", ["--strategy=mirrored"]) == STRATEGY_FRONT_ENDS["train"]
    assert module_of("finetune", ["--strategy", "mirrored"]) == "finetune_mirrored"
    for name, (module, _) in SUBCOMMANDS.items():
        assert (REPO / module.replace(".", "/")).with_suffix(".py").exists() or (
            REPO / module.replace(".", "/") / "__main__.py").exists(), (name, module)
    # The console script (setup.py) is the same command; a wrong subcommand is one line.
    script = Path(sys.executable).parent / "tfgpt"
    result = subprocess.run([script, "nope"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no subcommand 'nope'; choose from prepare, train" in result.stderr


def test_tfgpt_checkpoint_counts_the_models_parameters_and_reads_it_back(tmp_path):
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.checkpoint import save_weights

    model = GPT(vocabulary_size=37, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=24, max_sequence_length=8)
    model(tf.constant([[1, 2, 3]]))
    run_dir = tmp_path / "run"
    save_weights(str(run_dir), model, step=3)
    (run_dir / "ckpt-5").mkdir()  # a save that did not finish

    def tfgpt(*arguments):
        script = (f"import sys; from tfgpt.__main__ import main\n"
                  f"try:\n    main({[str(argument) for argument in arguments]!r})\n"
                  f"finally:\n    print('@@', 'tensorflow' in sys.modules)")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                cwd=REPO, timeout=120)
        return result.returncode, result.stdout, result.stderr

    code, output, errors = tfgpt("checkpoint", run_dir, "--keys")
    assert code == 0, errors
    assert output.rstrip().endswith("@@ False")  # read from the index alone
    assert (f"{run_dir / 'ckpt-3'}: step 3, written by 1 rank(s) = data 1 x pipeline 1 x "
            "tensor 1") in output, output
    weights = model.weights
    assert (f"model: {model.count_params():,} parameters in {len(weights)} tensor(s), "
            f"{4 * model.count_params() / 1024:.1f} KiB") in output, output
    assert "saves that did not finish (no index.json; resuming skips them): ckpt-5" in output
    assert "  lm_head/kernel" not in output  # tied: the token table is the head
    assert "  embeddings/token_embedding/embeddings  (37, 16) float32, 1 chunk(s) [model]" in output

    code, output, errors = tfgpt("checkpoint", run_dir / "ckpt-3", "--verify")
    assert code == 0, errors
    assert f"verified: every one of the {len(weights)} tensor(s) reads whole" in output
    (run_dir / "ckpt-3" / "rank-00000.npz").unlink()
    code, output, errors = tfgpt("checkpoint", run_dir, "--verify")
    assert code == 2 and errors.count("\n") == 1, errors
    assert "its index names 1 chunk file(s) that are missing: rank-00000.npz" in errors
    code, output, errors = tfgpt("checkpoint", tmp_path)
    assert code == 2 and "no checkpoint (ckpt-S/index.json) in it" in errors, errors
