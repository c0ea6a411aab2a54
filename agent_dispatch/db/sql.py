"""Statements kept in ``.sql`` package files, read with importlib.resources (they ship in the wheel).

A file holds named sections: a line ``-- name: <name>`` starts one, and it runs to the next such
line. Everything above the first one is the file's own commentary, and so are the comment lines
that open a section (they describe it; the statement starts below them). Sections may be templates
(``str.format`` fields, ``{{``/``}}`` for a literal brace); the module that owns a file renders them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Final

_LEADING_COMMENTS: Final = re.compile(r"\A(?:[ \t]*--[^\n]*\n)+")
_HEADER: Final = re.compile(r"^-- name: ([A-Za-z_][A-Za-z0-9_]*)[ \t]*$", re.MULTILINE)


@cache
def load(package: str, filename: str) -> Mapping[str, str]:
    """The sections of ``filename`` in ``package``, by name, each stripped of surrounding blank lines."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    sections: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in sections:
            raise ValueError(f"{package}/{filename}: section {name} appears twice")
        sections[name] = _LEADING_COMMENTS.sub("", body.strip("\n")).strip("\n")
    return MappingProxyType(sections)


def read(package: str, filename: str) -> str:
    """A whole ``.sql`` file of ``package`` (a script run as one statement string)."""
    return resources.files(package).joinpath(filename).read_text(encoding="utf-8")
