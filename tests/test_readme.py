"""The README's Python code runs: every ```python block, in order, in one fresh namespace.

Blocks run in a temporary working directory (the checkpoint snippet writes ``out/``), so the
README must not depend on the repository being the current directory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return PYTHON_BLOCK.findall(text)


def test_python_blocks_are_found():
    text = "a\n```python\nx = 1\n```\n```bash\nmake demo\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = x\n"]


def test_readme_has_the_quickstart_and_the_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(python_blocks(text)) >= 3
    setup = text.index("make demo")
    assert setup < text.index("## Quickstart")
    assert "make test" in text[: text.index("## Quickstart")]
    # One block runs `mtpjax.generate` beside `mtpjax.generate_baseline` on the shipped pair.
    assert any(
        "mtpjax.generate(" in b and "mtpjax.generate_baseline(" in b for b in python_blocks(text)
    )


def test_readme_python_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(README.read_text(encoding="utf-8"))):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as err:
            pytest.fail(f"README python block {i + 1} failed: {type(err).__name__}: {err}")
    out = capsys.readouterr().out
    # The quickstart decodes its prompt and continuation; the greedy rounds emitted tokens.
    assert out.startswith("def mean(data):")
    assert len(namespace["generated"]) > 8  # at least one token per round of 8
    # The generate block: greedy speculation equal to the plain decoder, in fewer target forwards.
    assert (namespace["spec"].tokens == namespace["plain"].tokens).all()
    assert int(namespace["spec"].target_steps) < int(namespace["plain"].target_steps)
    assert "target forwards after the prefill" in out
    assert (tmp_path / "out" / "tiny-mtp-nvfp4").is_dir()
