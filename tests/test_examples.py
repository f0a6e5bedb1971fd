"""The notebooks in examples/ are valid and run in a Jupyter kernel (in quick mode)."""

import json

import pytest

from tests.launch import REPO

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
def test_notebook_runs_in_a_jupyter_kernel_in_quick_mode(tmp_path, monkeypatch):
    # As a user runs it: every cell in order in an IPython kernel (nbclient),
    # which fails on the first cell that raises.
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TFGPT_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("TFGPT_NOTEBOOK_WORKDIR", str(tmp_path))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    output = "".join(item.get("text", "") for cell in notebook.cells
                     for item in cell.get("outputs", []))
    assert "validation loss" in output and "The built-in function" in output, output
    run_directory = tmp_path / "runs" / "notebook"
    assert sorted(path.name for path in run_directory.glob("ckpt-*")) == [
        "ckpt-01.weights.h5", "ckpt-02.weights.h5"]
    assert list((run_directory / "tensorboard" / "train").iterdir())
