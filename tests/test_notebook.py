"""notebooks/acceptance.ipynb runs headless on a reduced sweep and draws its figures.

The parameter cell (tagged ``parameters``) is replaced in memory before the run; the kernel is
ipykernel's own for this interpreter (no installed kernelspec is consulted), started with the
environment of the test session minus the forced host-device count of ``conftest.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "acceptance.ipynb"
REDUCED = """\
SWEEP = "reduced"
NUM_PROMPTS = 4
PROMPT_TOKENS = 48
MAX_NEW_TOKENS = 24
SEED = 0
"""
FIGURES = 8  # one per question: k, precision, temperature, contract, trees, sampled, length,
# fine-tuning
CELL_TIMEOUT_S = 300  # a hang guard; the whole reduced run takes well under this


def _parameter_cell(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    return tagged[0]


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def executed():
    """The notebook with the outputs of one reduced run."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    index = _parameter_cell(nb)
    nb.cells[index].source = REDUCED
    # The native kernel of this interpreter: with no kernel directories to search,
    # jupyter_client falls back to ipykernel's built-in spec, which runs sys.executable.
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    assert Path(km.kernel_spec.argv[0]).resolve() == Path(sys.executable).resolve()
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute(env=_kernel_env())
    return nb


def test_parameter_cell_defines_the_names_it_replaces():
    """The injected cell replaces every name the shipped parameter cell sets."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = nb.cells[_parameter_cell(nb)].source

    def names(text: str) -> set[str]:
        return {
            line.split("=", 1)[0].strip()
            for line in text.splitlines()
            if "=" in line and not line.lstrip().startswith("#")
        }

    assert names(source) == names(REDUCED)


def _images(nb) -> list:
    return [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "display_data" and "image/png" in out.get("data", {})
    ]


def test_saved_notebook_shows_the_full_sweep():
    """The committed notebook carries the figures of its full sweep, for readers on GitHub."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert 'SWEEP = "full"' in nb.cells[_parameter_cell(nb)].source
    assert len(_images(nb)) == FIGURES
    text = "".join(
        "".join(out.get("text", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "sweep 'full'" in text


def test_runs_without_errors(executed):
    for cell in executed.cells:
        if cell.cell_type != "code":
            continue
        assert cell.execution_count is not None
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{out.ename}: {out.evalue}"
            if out.output_type == "stream" and out.name == "stderr":
                assert "Traceback" not in out.text, out.text


def test_draws_one_figure_per_question(executed):
    images = _images(executed)
    assert len(images) == FIGURES
    for out in images:
        assert len(out.data["image/png"]) > 10_000  # base64 of a drawn figure, not a blank one


def test_reports_the_reduced_sweep(executed):
    text = "".join(
        out.get("text", "")
        for cell in executed.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "stream"
    )
    assert "sweep 'reduced'" in text
    assert "greedy k=3 runs generate the base run's tokens exactly" in text
