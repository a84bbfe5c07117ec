"""The `mtpjax` command line: --version, the subcommands --help lists, and `convert` handing its
arguments to the converter untouched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mtpjax
import mtpjax.checkpoint
from mtpjax.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"mtpjax {mtpjax.__version__}"


def test_version_from_a_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "mtpjax", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"mtpjax {mtpjax.__version__}"


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert "{selfcheck,demo,generate,convert,finetune}" in usage


@pytest.mark.parametrize(
    "argv",
    [
        ["SRC", "OUT", "--precision", "nvfp4", "--force"],
        ["--help"],
        [],
    ],
)
def test_convert_forwards_its_arguments(monkeypatch, argv):
    seen = []

    def convert_main(args):
        seen.append(args)
        return 7

    monkeypatch.setattr(mtpjax.checkpoint, "convert_main", convert_main, raising=False)
    assert main(["convert", *argv]) == 7
    assert seen == [argv]


@pytest.mark.parametrize("argv", [["--out", "OUT", "--steps", "5"], ["--help"]])
def test_finetune_forwards_its_arguments(monkeypatch, argv):
    import mtpjax.train

    seen = []

    def finetune_main(args):
        seen.append(args)
        return 7

    monkeypatch.setattr(mtpjax.train, "finetune_main", finetune_main)
    assert main(["finetune", *argv]) == 7
    assert seen == [argv]


def test_missing_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert "required: command" in capsys.readouterr().err
