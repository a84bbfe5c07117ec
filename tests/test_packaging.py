"""What a pip user gets: the license the metadata names, a GPU extra that pins the plugin of the
pinned JAX, declared dependencies that are all used, the shipped pair inside the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(requirements: list[str]) -> dict[str, str]:
    """{name: version} of the `name==version` requirements (extras in brackets dropped)."""
    pins = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", req)
        if match:
            pins[match[1]] = match[2]
    return pins


def test_license_file_is_the_apache_2_0_text():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_cuda_extra_pins_the_jax_of_the_dependencies():
    jax_version = _pins(PROJECT["dependencies"])["jax"]
    extras = PROJECT["optional-dependencies"]
    for extra, plugin in (("cuda", "cuda13"), ("cuda12", "cuda12")):
        assert extras[extra] == [f"jax[{plugin}]=={jax_version}"]
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[cuda]'" in readme


def test_every_declared_dependency_is_imported():
    """A dependency nothing imports is dead weight for every pip user (flax was one)."""
    # jaxlib is jax's compiled half, reached through `import jax`; pinned beside it.
    imports = {"orbax-checkpoint": "orbax", "jaxlib": "jax"}
    sources = "\n".join(
        p.read_text() for d in ("mtpjax", "pallas_kernels") for p in (ROOT / d).rglob("*.py")
    )
    for req in PROJECT["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", req)[0]
        module = imports.get(name, name.replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {module}\b", sources, re.MULTILINE), name


def test_the_shipped_pair_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["mtpjax"]
    package = ROOT / "mtpjax"
    shipped = {p for p in (package / "assets").rglob("*") if p.is_file()}
    assert {p.relative_to(package).as_posix() for p in shipped} >= {
        "assets/tiny_pair/config.json",
        "assets/tiny_pair/model.safetensors",
        "assets/tiny_pair/tokenizer.json",
        "assets/tiny_pair/heldout_files.txt",
    }
    covered = {p for g in globs for p in package.glob(g) if p.is_file()}
    assert shipped <= covered
