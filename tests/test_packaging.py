"""The installed package is the source tree: pyproject.toml lists every package (a regular, non-editable
install ships only what is listed; editable installs hide a missing one). .ci/wheel_check.sh builds the
wheel and imports every module from a fresh environment."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages():
    """Dotted names of the folders with an __init__.py under fa3/ and kernels/ (installed as fa3.kernels)."""
    found = set()
    for top, installed in (("fa3", "fa3"), ("kernels", "fa3.kernels")):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(folder, os.path.join(ROOT, top))
                found.add(installed if rel == "." else installed + "." + rel.replace(os.sep, "."))
    return found


def test_pyproject_lists_every_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    assert _source_packages() - listed == set(), "packages missing from pyproject.toml"
    assert listed - _source_packages() == set(), "pyproject.toml lists packages that do not exist"
    for name, folder in setuptools["package-dir"].items():
        assert os.path.isfile(os.path.join(ROOT, folder, "__init__.py")), (name, folder)
