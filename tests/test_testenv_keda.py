"""testenv/keda.py's go.mod handling: KEDA's replace and exclude directives reach the throwaway module
that builds it (a dependent module does not inherit them)."""

from __future__ import annotations

from testenv.keda import _module_directives

GO_MOD = """module github.com/kedacore/keda/v2

go 1.26.0

// Needed replaces
replace github.com/a/b v0.1.0 => github.com/a/b v0.1.1-0.20260629224316-835bd8d49cb4

exclude github.com/go-chi/chi/v5 v5.2.3

replace (
\tgithub.com/c/d => github.com/c/d v1.2.3 // pinned
\t// a comment line inside the block

\tgithub.com/e/f v1.0.0 => github.com/g/f v1.0.1
)

require (
\tgithub.com/replace/me v1.0.0
\tk8s.io/api v0.36.4
)
"""


def test_replace_and_exclude_lines_are_copied_and_nothing_else() -> None:
    assert _module_directives(GO_MOD).splitlines() == [
        "replace github.com/a/b v0.1.0 => github.com/a/b v0.1.1-0.20260629224316-835bd8d49cb4",
        "exclude github.com/go-chi/chi/v5 v5.2.3",
        "replace github.com/c/d => github.com/c/d v1.2.3",
        "replace github.com/e/f v1.0.0 => github.com/g/f v1.0.1",
    ]


def test_a_go_mod_without_directives_adds_nothing() -> None:
    assert _module_directives("module x\n\ngo 1.22\n\nrequire k8s.io/api v0.36.4\n") == ""
