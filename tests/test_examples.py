"""The notebooks in examples/ are valid and their code runs (in quick mode)."""

import json
import sys

import pytest

from tests.launch import REPO, run

NOTEBOOK = REPO / "examples" / "train_with_model_fit.ipynb"


def code_cells(path):
    notebook = json.loads(path.read_text())
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_notebook_is_nbformat_4_without_outputs():
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4 and notebook["nbformat_minor"] >= 5
    assert notebook["metadata"]["kernelspec"]["language"] == "python"
    ids = [cell["id"] for cell in notebook["cells"]]
    assert len(set(ids)) == len(ids)
    for cell in notebook["cells"]:
        assert cell["cell_type"] in ("markdown", "code")
        assert isinstance(cell["source"], list) and isinstance(cell["metadata"], dict)
        if cell["cell_type"] == "code":
            # Committed without outputs, so a diff shows only code changes.
            assert cell["outputs"] == [] and cell["execution_count"] is None
    # Plain Python: no IPython magics or shell escapes that a script cannot run.
    for source in code_cells(NOTEBOOK):
        compile(source, str(NOTEBOOK), "exec")
        assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines())


@pytest.mark.slow
def test_notebook_code_runs_end_to_end_in_quick_mode(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text("\n\n".join(code_cells(NOTEBOOK)) + "\n")
    code, output = run(
        [sys.executable, script],
        env={"TFGPT_NOTEBOOK_QUICK": "1", "TFGPT_NOTEBOOK_WORKDIR": str(tmp_path)},
    )
    assert code == 0, output
    assert "validation loss" in output and "The built-in function" in output, output
    run_directory = tmp_path / "runs" / "notebook"
    assert sorted(path.name for path in run_directory.glob("ckpt-*")) == [
        "ckpt-01.weights.h5", "ckpt-02.weights.h5"]
    assert list((run_directory / "tensorboard" / "train").iterdir())
