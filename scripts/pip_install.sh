#!/usr/bin/env bash
# Install Python packages into PYTHON's environment: scripts/pip_install.sh ARGS...
# takes what `pip install` takes (-r FILE, -e ., --no-deps, --upgrade, -q, wheels).
#
# With uv in that environment (scripts/setup.sh puts it there) the install is
# `uv pip install`: it resolves the same versions as pip, unpacks in parallel and
# links from its cache (~/.cache/uv), so a second venv on the machine takes
# seconds where pip takes minutes (bench/RESULTS.md, "Set-up"). uv does not read
# pip's configuration, so the index, extra indexes, find-links and constraint
# files that `pip config list` shows (pip.conf files and PIP_* variables) are
# passed on as flags, and the indexes are merged as pip merges them
# (--index-strategy unsafe-best-match); modules are compiled to bytecode as pip
# compiles them, or the first import of TensorFlow would. Without uv, or with
# TFGPT_INSTALLER=pip, it is pip itself.
set -euo pipefail

PYTHON="${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python}"
UV="$(dirname "$PYTHON")/uv"

if [[ "${TFGPT_INSTALLER:-uv}" != "uv" || ! -x "$UV" ]]; then
  exec "$PYTHON" -m pip install "$@"
fi

# `pip config list` prints KEY='VALUE' lines, KEY being SECTION.NAME with
# :env: for PIP_* variables; a variable overrides the files' value of its key.
mapfile -t PIP_CONFIG < <("$PYTHON" - <<'EOF'
import shlex, subprocess, sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                        capture_output=True, text=True, check=True).stdout
values = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.partition(".")
    if section not in (":env:", "global", "install"):
        continue
    words = shlex.split(value)[0].split() if value else []
    if section == ":env:" or name not in values:
        values[name] = words
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
for name, flag in flags.items():
    for word in values.get(name, []):
        print(flag)
        print(word)
if values.get("no-index", ["0"])[0].lower() in ("1", "true", "yes", "on"):
    print("--no-index")
EOF
)

exec "$UV" pip install --python "$PYTHON" --index-strategy unsafe-best-match --compile-bytecode \
  "${PIP_CONFIG[@]}" "$@"
