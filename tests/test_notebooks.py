"""Execute every notebook in notebooks/ headless (nbclient), the way a reader would run it top to bottom."""
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})  # cwd = notebooks/
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # its message holds the failing cell and traceback
        pytest.fail(f"{path.name} failed:\n" + re.sub(r"\x1b\[[0-9;]*m", "", str(e)), pytrace=False)
