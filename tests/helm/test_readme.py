"""The README's Kubernetes block: its shape here; tests/node/test_readme.py runs every command of it,
in order, on a real node."""

from __future__ import annotations

import re
import shlex

from tests.helm._support import ROOT

MARKER = "<!-- The block below is run, command by command, by tests/node/test_readme.py on a real node. -->"
README_NAMESPACE = "agent-dispatch"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(MARKER)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.DOTALL)
    assert block is not None, "the README's Kubernetes section lost its bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_block_is_the_walkthrough_the_issue_asks_for() -> None:
    commands = readme_commands()
    tools = [shlex.split(c)[:2] for c in commands]
    assert tools[0] == ["helm", "install"]
    assert ["kubectl", "-n"] in tools
    assert any(" apply -f examples/" in c for c in commands)
    assert any(" get agentdispatch" in c for c in commands)
    assert tools[-1] == ["helm", "uninstall"]


def localise(args: list[str], namespace: str) -> list[str]:
    """The README's namespace becomes a fresh one; relative paths become absolute (any cwd works)."""
    out: list[str] = []
    for index, arg in enumerate(args):
        if index > 0 and args[index - 1] in {"-n", "--namespace"} and arg == README_NAMESPACE:
            out.append(namespace)
        elif not arg.startswith("-") and "/" in arg and (ROOT / arg).exists():
            out.append(str(ROOT / arg))
        else:
            out.append(arg)
    return out
