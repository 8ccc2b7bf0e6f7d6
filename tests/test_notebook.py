"""docs/tour.ipynb, the guided tour: stored as it ran (in order, no errors, small), and it runs top to bottom in a
Jupyter kernel (nbclient: what a learner's Jupyter does) on the real model."""
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "docs" / "tour.ipynb"


def test_the_tour_is_stored_as_it_ran_in_order_and_small():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))   # top to bottom, once
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert NOTEBOOK.stat().st_size < 150_000                                        # outputs kept small
    text = "".join("".join(c["source"]) for c in nb["cells"])
    for topic in ("tokenizer.encode", "trace.attention", "logit_lens", ".stages", "decode_step", "Exercises"):
        assert topic in text, topic


@pytest.mark.slow
def test_the_tour_runs_top_to_bottom():
    nbclient = pytest.importorskip("nbclient", reason='the notebook extra: pip install -e ".[notebook]"')
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = {o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs}
    assert any("accepted" in o for o in outputs)                                     # it reached the last exercise
