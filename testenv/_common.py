"""Shared plumbing for the loopback test services: cache paths, ports, processes, logs."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Self

CACHE_ROOT = Path(os.environ.get("AGENT_DISPATCH_CACHE", Path.home() / ".cache" / "agent-dispatch"))


class ServiceUnavailable(RuntimeError):
    """A test service could not be installed or started; the message ends with its log tail."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def cache_dir(*parts: str) -> Path:
    path = CACHE_ROOT.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])


def progress(message: str) -> None:
    """Long set-up steps (builds, downloads) say what they are doing on stderr."""
    print(f"[testenv] {message}", file=sys.stderr, flush=True)


def run_logged(
    cmd: Sequence[str | os.PathLike[str]],
    log: Path,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> None:
    """Run a set-up command, appending its output to ``log``; raise ServiceUnavailable with the tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        try:
            proc = subprocess.run(
                list(map(str, cmd)),
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceUnavailable(f"{cmd[0]} timed out after {timeout}s\n{log_tail(log)}") from exc
    if proc.returncode != 0:
        raise ServiceUnavailable(f"{' '.join(map(str, cmd[:3]))} exited {proc.returncode}\n{log_tail(log)}")


APT_TIMEOUT_S = 900


def apt_get(args: Sequence[str], log: Path) -> None:
    """Run apt-get non-interactively, logging to ``log``; raise ServiceUnavailable with the tail."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Another process (a colleague's install, unattended upgrades) may hold the dpkg lock: wait for it.
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=300", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=APT_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ServiceUnavailable(f"apt-get {args[0]} failed: {exc}\n{log_tail(log)}") from exc
    if proc.returncode != 0:
        raise ServiceUnavailable(f"apt-get {' '.join(args)} exited {proc.returncode}\n{log_tail(log)}")


def apt_install(packages: Sequence[str], log: Path) -> None:
    """Install Debian packages (once per machine; needs root)."""
    if os.geteuid() != 0:
        raise ServiceUnavailable(f"{', '.join(packages)} not installed and installing needs root (apt-get)")
    progress(f"installing {', '.join(packages)} with apt-get (once per machine)")
    apt_get(["update"], log)
    apt_get(["install", "-y", "--no-install-recommends", *packages], log)


@contextlib.contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Serialise work across processes (parallel pytest sessions, .ci/run) without waiting forever."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"another process held {path} for {timeout:.0f}s") from None
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def wait_until(
    check: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    log: Path | None = None,
    proc: subprocess.Popen[bytes] | None = None,
    interval: float = 0.2,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_tail(log) if log else ""
            raise ServiceUnavailable(f"{what} exited with code {proc.returncode}\n{tail}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(interval)
    tail = log_tail(log) if log else ""
    raise ServiceUnavailable(f"{what} not ready after {timeout:.0f}s\n{tail}")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"agent-dispatch-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def go_env() -> dict[str, str]:
    """Environment for Go builds: caches live beside the project's other cached artefacts."""
    env = dict(os.environ)
    env.setdefault("GOMODCACHE", str(cache_dir("go", "mod")))
    env.setdefault("GOCACHE", str(cache_dir("go", "build")))
    env.setdefault("GOFLAGS", "-mod=mod")
    env.setdefault("CGO_ENABLED", "0")
    return env


STOP_TIMEOUT_S = 30
PORT_ATTEMPTS = 3


def lost_port_race(log: Path) -> bool:
    # free_port() only says a port was free a moment ago; another process may bind it first.
    return "Address already in use" in log_tail(log, lines=200)


class LoopbackService:
    """The lifecycle every loopback test server shares: start (retrying a lost port race), stop
    gently or crash-like, restart on the same directory and ports, close, and stop at exit.

    A subclass names itself (``NAME``), its two stop signals, where it logs, and how to prepare
    a fresh directory (``_prepare``, which sets ``_root``) and launch the process (``_launch``).
    """

    NAME = "service"
    STOP_SIGNAL = signal.SIGTERM
    CRASH_SIGNAL = signal.SIGKILL

    def __init__(self) -> None:
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._atexit_registered = False

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def _prepare(self) -> None:
        raise NotImplementedError

    def _launch(self) -> None:
        raise NotImplementedError

    def _stop_at_exit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Prepare on first call, then launch and wait until the server serves."""
        with self._lock:
            if self.running:
                return self
            if self._root is not None:  # stopped earlier: same directory and ports
                self._launch()
                return self
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self._prepare()
                try:
                    self._launch()
                    return self
                except ServiceUnavailable:
                    if attempt == PORT_ATTEMPTS or not lost_port_race(self.log_path):
                        raise
                    progress(
                        f"{self.log_path.name}: a free port was taken before the server bound it; retrying"
                    )
                    self.close()
            raise AssertionError("unreachable")

    def stop(self, *, immediate: bool = False) -> None:
        """Graceful shutdown or, with immediate=True, a crash-like stop."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None or proc.poll() is not None:
                return
            proc.send_signal(self.CRASH_SIGNAL if immediate else self.STOP_SIGNAL)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)

    def restart(self, *, immediate: bool = False) -> None:
        """Same directory and ports, so clients holding an address reconnect by themselves."""
        with self._lock:
            if self._root is None:
                raise ServiceUnavailable(f"{self.NAME} has not been started, so it cannot restart")
            self.stop(immediate=immediate)
            self._launch()

    def close(self) -> None:
        """Stop and delete the server's directory (runs at interpreter exit too)."""
        with self._lock:
            self.stop()
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def unmount_under(root: Path) -> None:
    """Unmount (lazily, deepest first) every mount point under ``root``."""
    prefix = str(root.resolve()) + "/"
    mounts = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix) or point == prefix.rstrip("/"):
                mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=30)
