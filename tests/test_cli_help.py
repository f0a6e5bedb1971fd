"""Every command's `--help`: each flag explained, enumerated flags list their
choices, and no TensorFlow imported (so no TensorFlow log line either)."""

import json
import os
import subprocess
import sys

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
    ("bench.profile_summary", [], {}),
    ("bench.scaling", [], {"--preset": PRESETS,
                           "--kinds": ["horovod", "multi-worker", "independent"],
                           "--zero-stages": [0, 1, 2, 3]}),
    ("bench.throughput", [], {"--preset": PRESETS, "--configs": None}),
    ("bench.throughput", ["worker"], {"--framework": ["tf", "torch", "peak"],
                                      "--precision": ["fp32", "bf16"], "--preset": PRESETS}),
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
    for flag, entry in declared.items():
        if flag == "--help":
            continue
        assert entry["help"], f"{module}: {flag} has no help text"
        for choice in entry["choices"]:
            assert str(choice) in text, f"{module}: {flag}'s choice {choice!r} is not listed"
    for flag, choices in enumerated.items():
        assert flag in declared, f"{module}: no {flag}"
        assert declared[flag]["choices"], f"{module}: {flag} takes any value"
        if choices is not None:
            assert declared[flag]["choices"] == choices, (flag, declared[flag]["choices"])
    # Defaults are shown (tfgpt.cli.HelpFormatter).
    if any(entry["flag"].startswith("--") and entry["flag"] != "--help"
           for entry in report["declared"]):
        assert "(default: " in text, text


def test_convert_help_lists_its_subcommands():
    text, _, report = _help("tfgpt.convert", [])
    assert report["code"] == 0 and not report["tensorflow"]
    listed = text.split("positional arguments:")[1]
    assert "to-tfgpt" in listed and "to-gpt2" in listed, text
