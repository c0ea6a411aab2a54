"""Shared plumbing for ``python -m bench.run``: processes, timing, the machine's description."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("AGENT_DISPATCH_CACHE", Path.home() / ".cache" / "agent-dispatch")) / "bench"
KEY = "bench-signing-key-" + "k" * 32
#: Worker threads per worker process, for us and for every peer (their per-process concurrency).
CONCURRENCY = 4
#: Jobs per batch-insert call, for us (enqueue_many) and for every peer (its batch insert API).
BATCH = 100
#: The systems' names in results and tables.
OURS = "agent-dispatch"
RAW_PG = "raw psycopg loop"
RAW_SQLITE = "raw sqlite3 loop"
RAW_KAFKA = "raw confluent-kafka loop"
RAW_KAFKA_STORE = "raw confluent-kafka + psycopg loop"
#: Environment without anything of ours that a developer may have exported.
BASE_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB", "KAFKA_", "PG"))
}


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- processes ------------------------------------------------------------------------------------


@dataclass
class Proc:
    """A child process whose stdout lines are collected (for ``ready`` / ``start <t>`` lines)."""

    name: str
    popen: subprocess.Popen[str]
    log: Path
    lines: list[str] = field(default_factory=list)
    #: Wall-clock time when ``wait_drained`` first saw the process gone (0 until then).
    exited_at: float = 0.0
    _reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.popen.poll() is not None and not (self._reader and self._reader.is_alive()):
                break
            time.sleep(0.02)
        raise RuntimeError(
            f"{self.name}: no {prefix!r} line within {timeout:.0f}s (exit {self.popen.poll()}):\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self._reader is not None:
            self._reader.join(2)


def spawn(
    name: str, cmd: Sequence[str], *, env: dict[str, str], log_dir: Path, cwd: Path | None = None
) -> Proc:
    """Start ``cmd``; stdout lines are kept (and logged), stderr goes to the log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    err = log.open("a")
    popen = subprocess.Popen(
        list(cmd),
        env=env,
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=err,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    err.close()
    proc = Proc(name, popen, log)

    def read() -> None:
        assert popen.stdout is not None
        with log.open("a") as out:
            for line in popen.stdout:
                proc.lines.append(line.strip())
                out.write(line)
                out.flush()

    proc._reader = threading.Thread(target=read, daemon=True)
    proc._reader.start()
    return proc


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def run_checked(
    cmd: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 900
) -> str:
    """Run a set-up command; raise with the command and its output's tail when it fails."""
    proc = subprocess.run(
        list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise SetupFailed(" ".join(cmd), tail)
    return proc.stdout


class SetupFailed(RuntimeError):
    def __init__(self, command: str, output: str) -> None:
        super().__init__(f"`{command}` failed:\n{output}")
        self.command = command
        self.output = output


# --- /proc ------------------------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU time every core of the machine has spent busy so far (``/proc/stat``: all but idle and
    I/O wait), so a window's difference is the CPU that everything running took in it."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen


def machine() -> dict[str, Any]:
    """Cores, memory, CPU model, kernel, load: never the host name."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = float("nan")
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 1024 / 1024
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "os": platform.system(),
    }


def tool_version(cmd: Sequence[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    return "unavailable"


# --- PostgreSQL -------------------------------------------------------------------------------------


def scalar(dsn: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


class Poller:
    """One connection that runs a count query until it reports zero (turns left to finish)."""

    def __init__(self, dsn: str, query: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.query = query

    def remaining(self) -> int:
        row = self.conn.execute(self.query).fetchone()  # type: ignore[arg-type]
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


def wait_drained(poll: Callable[[], int], inserter: Proc, *, timeout: float, interval: float = 0.05) -> float:
    """Wall-clock time when the inserter has exited and nothing is left to do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done_inserting = inserter.popen.poll() is not None
        if done_inserting and inserter.exited_at == 0.0:
            inserter.exited_at = time.time()
        if done_inserting and inserter.popen.returncode != 0:
            raise RuntimeError(f"{inserter.name} exited {inserter.popen.returncode}:\n{inserter.tail()}")
        if done_inserting and poll() == 0:
            return time.time()
        time.sleep(interval)
    raise RuntimeError(f"not drained within {timeout:.0f}s ({poll()} left)")


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]
