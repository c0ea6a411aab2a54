"""Packaging metadata that build tools accept without deprecation warnings."""

from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_license_is_an_spdx_expression_with_a_backend_that_reads_it() -> None:
    """A ``license`` table is deprecated by setuptools (cut-off 2027-02-18); the SPDX string form
    (PEP 639) needs setuptools 77 or newer, which the build system must then require."""
    project = tomllib.loads(PYPROJECT.read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert not any("License ::" in c for c in project["project"].get("classifiers", []))
    requires = project["build-system"]["requires"]
    assert "setuptools>=77" in requires, requires
