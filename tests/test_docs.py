"""The examples of README.md and docs/ stay true to the code.

Every command of a ```bash block that runs one of tfgpt's front ends
(train_hvd.py and the other three, `python -m pipelines.prepare`,
`tfgpt.*`, `bench.*`, the `tfgpt` command) is given, flags and all, to that
front end's own parser, which must accept it: a renamed or removed flag, or
a choice no longer offered, fails here. (Parsing stops there: the commands
name your corpus, several hosts or hours of training; the tests each page
names run the same code on tiny models.) Every ```python block compiles,
its imports resolve, and each call of a function or class it imported
binds to that callable's signature: a renamed keyword fails here. (The
blocks run, at tiny sizes, in tests/test_docs_examples.py.) And the site
builds as `make docs` builds it, a warning failing it.
"""

import ast
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ("train_hvd.py", "train_mirrored.py", "finetune_hvd.py", "finetune_mirrored.py")
MODULES = re.compile(r"^(pipelines\.prepare|tfgpt(\.[a-z_.]+)?|bench\.[a-z_]+)$")

# Runs a front end as `python -m MODULE` (or a script) does, up to its first
# parse (parse_args goes through parse_known_args): exit 0 once every flag
# is known and parses, argparse's 2 with its message if not. (What the front
# end checks after parsing, such as the data directory, is not reached.)
PARSE_ONLY = """
import argparse, runpy, sys
class Parsed(BaseException):
    pass
parse_known_args = argparse.ArgumentParser.parse_known_args
def parse_and_stop(self, args=None, namespace=None):
    _, unknown = parse_known_args(self, args, namespace)
    if unknown:
        self.error("unrecognized arguments: " + " ".join(unknown))
    raise Parsed
argparse.ArgumentParser.parse_known_args = parse_and_stop
kind, target, sys.argv = sys.argv[1], sys.argv[2], [sys.argv[2], *sys.argv[3:]]
try:
    if kind == "script":
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
except Parsed:
    sys.exit(0)
sys.exit("the front end ran past its flags without parsing them")
"""


def blocks(language):
    """`(page, line, text)` of every ```language block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
            found.append((page, text[:match.start()].count("\n") + 2, match.group(1)))
    return found


def front_end_commands():
    """`(where, kind, target, arguments)` of each front-end command of the bash blocks."""
    commands = []
    for page, line, text in blocks("bash"):
        for number, command in enumerate(text.replace("\\\n", " ").splitlines()):
            words = shlex.split(command, comments=True)
            where = f"{page.relative_to(REPO)}:{line + number}"
            for index, word in enumerate(words):
                rest = words[index + 1:]
                if word.endswith(SCRIPTS):
                    found = ("script", str(REPO / word.rsplit("/", 1)[-1]), rest)
                elif word == "-m" and rest and MODULES.match(rest[0]):
                    found = ("module", rest[0], rest[1:])
                elif word.endswith("/tfgpt") or word == "tfgpt":
                    found = ("module", "tfgpt", rest)
                else:
                    continue
                # `...` and [optional] words are the page's placeholders.
                arguments = [word for word in found[2]
                             if word != "..." and not word.startswith("[")
                             and not word.endswith("]")]
                commands.append((where, found[0], found[1], arguments))
                break
    return commands


COMMANDS = front_end_commands()


def test_the_pages_show_the_front_ends():
    # The extraction itself: the quick start's three steps are among them.
    targets = {target.rsplit("/", 1)[-1] for _, _, target, _ in COMMANDS}
    assert {"pipelines.prepare", "train_hvd.py", "tfgpt.generate"} <= targets, targets
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("where, kind, target, arguments", COMMANDS,
                         ids=[where for where, *_ in COMMANDS])
def test_each_command_parses_with_its_front_ends_flags(where, kind, target, arguments):
    result = subprocess.run([sys.executable, "-c", PARSE_ONLY, kind, target, *arguments],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, f"{where}: {target} {' '.join(arguments)}\n{result.stderr}"
    assert "tensorflow" not in result.stderr.lower(), result.stderr  # parsed before it starts


def _imports(tree):
    """`{name: object}` the module `tree` imports (ImportError names the missing one)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                names[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module(alias.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _callee(node, names):
    """The object a call's function names through the imports, or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _callee(node.value, names)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


PYTHON_BLOCKS = blocks("python")


@pytest.mark.parametrize("page, line, source", PYTHON_BLOCKS, ids=[
    f"{page.relative_to(REPO)}:{line}" for page, line, _ in PYTHON_BLOCKS])
def test_each_python_example_imports_and_calls_what_exists(page, line, source):
    where = f"{page.relative_to(REPO)}:{line}"
    tree = ast.parse(source, where)
    names = _imports(tree)
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(
                isinstance(argument, ast.Starred) for argument in node.args) or any(
                keyword.arg is None for keyword in node.keywords):
            continue
        callee = _callee(node.func, names)
        if callee is None or not callable(callee) or inspect.ismodule(callee):
            continue
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):  # a builtin without one
            continue
        try:
            signature.bind(*node.args, **{keyword.arg: None for keyword in node.keywords})
        except TypeError as error:
            pytest.fail(f"{where}, line {node.lineno}: {ast.unparse(node.func)}: {error}")
        checked += 1
    assert checked or not names, f"{where}: no call of what it imports was checked"


def test_the_site_builds_as_make_docs_builds_it_without_a_warning(tmp_path):
    recipe = (REPO / "Makefile").read_text().split("\ndocs:", 1)[1]
    assert "mkdocs build --strict" in recipe
    result = subprocess.run(
        [str(REPO / ".venv" / "bin" / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "index.html").exists() and (tmp_path / "api" / "index.html").exists()
