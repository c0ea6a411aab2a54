"""A throwaway PostgreSQL server on loopback, built from the machine's Debian packages.

The server runs from a temporary data directory owned by an unprivileged OS user (PostgreSQL
refuses to run as root), listens on 127.0.0.1 on a free port and trusts every loopback
connection. It is tuned for tests, not durability: fsync and friends are off.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import LiteralString

from testenv._common import (
    LoopbackService,
    ServiceUnavailable,
    apt_get,
    free_port,
    log_tail,
    progress,
    wait_until,
)

PG_ROOT = Path("/usr/lib/postgresql")
TEST_USER = "agentdispatch-test"
SUPERUSER = "postgres"
START_TIMEOUT_S = 60
_DBNAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# Test speed over durability; max_connections leaves room for pools of many workers at once.
SERVER_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "shared_buffers": "128MB",
    "log_line_prefix": "'%m [%p] %d '",
}


@dataclass(frozen=True)
class Installation:
    bindir: Path
    version: str  # e.g. "PostgreSQL 15.18"


def _find_bindir() -> Path | None:
    """Newest major version under /usr/lib/postgresql that has the three binaries we run."""
    candidates = []
    for bindir in PG_ROOT.glob("*/bin"):
        if all((bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            major = bindir.parent.name
            candidates.append((int(major) if major.isdigit() else 0, bindir))
    return max(candidates)[1] if candidates else None


def _disable_main_cluster() -> None:
    """Debian's package creates and starts a 'main' cluster on 5432; tests never use it, so skip it."""
    conf = Path("/etc/postgresql-common/createcluster.conf")
    if conf.is_file() and "\ncreate_main_cluster = false" not in conf.read_text():
        with conf.open("a") as handle:
            handle.write(
                "\n# agent-dispatch test environment: no default cluster\ncreate_main_cluster = false\n"
            )


def _apt_install(log: Path) -> None:
    if os.geteuid() != 0:
        raise ServiceUnavailable("PostgreSQL is not installed and installing it needs root (apt-get)")
    progress("installing PostgreSQL with apt-get (once per machine)")
    apt_get(["update"], log)
    apt_get(["install", "-y", "--no-install-recommends", "postgresql-common"], log)
    _disable_main_cluster()
    apt_get(["install", "-y", "--no-install-recommends", "postgresql"], log)


def _server_version(bindir: Path) -> str:
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    match = re.search(r"\(PostgreSQL\)\s+(\S+)", out)
    if not match:
        raise ServiceUnavailable(f"cannot read the PostgreSQL version from {out!r}")
    return f"PostgreSQL {match.group(1)}"


def ensure_installed(log: Path | None = None) -> Installation:
    """Find the Debian PostgreSQL binaries, installing the package first when they are missing."""
    bindir = _find_bindir()
    if bindir is None:
        log = log or Path(tempfile.gettempdir()) / "agent-dispatch-postgres-install.log"
        _apt_install(log)
        bindir = _find_bindir()
        if bindir is None:
            raise ServiceUnavailable(
                f"apt-get installed postgresql but no initdb under {PG_ROOT}\n{log_tail(log)}"
            )
    return Installation(bindir=bindir, version=_server_version(bindir))


@dataclass(frozen=True)
class _OsUser:
    name: str
    uid: int
    gid: int


def _unprivileged_user() -> _OsUser | None:
    """The account the server runs as: None means 'this process', which is fine unless we are root."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(TEST_USER)
        return _OsUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
    # A concurrent test process may create the user at the same moment, so ignore failure and re-check.
    subprocess.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            TEST_USER,
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    for name in (TEST_USER, "nobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return _OsUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
    raise ServiceUnavailable(f"no unprivileged OS user ({TEST_USER} or nobody) to run PostgreSQL as")


class PostgresServer(LoopbackService):
    """One PostgreSQL cluster on 127.0.0.1; `start()` it, hand `dsn` to tests, `stop()` or `restart()` it."""

    NAME = "PostgreSQL server"
    # Fast shutdown aborts sessions (SIGTERM would wait for every client to leave); SIGQUIT is
    # PostgreSQL's immediate, crash-like stop.
    STOP_SIGNAL = signal.SIGINT
    CRASH_SIGNAL = signal.SIGQUIT

    def __init__(self, *, host: str = "127.0.0.1", clients: str = "127.0.0.1/32") -> None:
        """``host`` is the address clients use (loopback, or the host end of a test node's veth);
        ``clients`` the network trusted to connect from (the node's pods are masqueraded into it)."""
        super().__init__()
        self.host = host
        self.clients = clients
        self._install: Installation | None = None
        self._user: _OsUser | None = None
        self.port = 0
        self.version = ""

    # -- public attributes ------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """Superuser DSN for the `postgres` database."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{dbname}"

    @property
    def log_path(self) -> Path:
        return self._workdir / "postgres.log"

    @property
    def data_dir(self) -> Path:
        return self._workdir / "data"

    # -- databases ---------------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create an empty database and return a superuser DSN for it."""
        self._execute("CREATE DATABASE {}", _checked_name(name))
        return self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database even while clients are still connected to it."""
        self._execute("DROP DATABASE IF EXISTS {} WITH (FORCE)", _checked_name(name))

    def _execute(self, template: LiteralString, name: str) -> None:
        import psycopg
        from psycopg import sql

        # CREATE/DROP DATABASE cannot run inside a transaction block, hence autocommit.
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn:
                conn.execute(sql.SQL(template).format(sql.Identifier(name)))
        except psycopg.OperationalError as exc:
            raise ServiceUnavailable(f"PostgreSQL: {exc}\n{log_tail(self.log_path)}") from exc

    # -- internals ---------------------------------------------------------------------------

    @property
    def _workdir(self) -> Path:
        if self._root is None:
            raise ServiceUnavailable("PostgreSQL server has not been started")
        return self._root

    def _prepare(self) -> None:
        self._install = ensure_installed()
        self.version = self._install.version
        self._user = _unprivileged_user()
        # The tempdir must be reachable by the server's user: the default temp dir is world-traversable.
        root = Path(tempfile.mkdtemp(prefix="agent-dispatch-pg-"))
        if self._user is not None:
            os.chown(root, self._user.uid, self._user.gid)
        self._root = root
        self._stop_at_exit()
        self._initdb()
        self.port = free_port()
        self._write_config()

    def _run_as_user(self, cmd: Sequence[str], *, timeout: float) -> None:
        with self.log_path.open("ab") as out:
            out.write(f"\n$ {' '.join(cmd)}\n".encode())
            out.flush()
            try:
                proc = subprocess.run(
                    list(cmd),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=self._workdir,
                    env=self._env(),
                    timeout=timeout,
                    check=False,
                    user=self._uid,
                    group=self._gid,
                    extra_groups=self._extra_groups,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ServiceUnavailable(f"{cmd[0]} failed: {exc}\n{log_tail(self.log_path)}") from exc
        if proc.returncode != 0:
            raise ServiceUnavailable(
                f"{Path(cmd[0]).name} exited {proc.returncode}\n{log_tail(self.log_path)}"
            )

    # Privilege drop for every server-side command; None everywhere means "run as this process".
    @property
    def _uid(self) -> int | None:
        return self._user.uid if self._user else None

    @property
    def _gid(self) -> int | None:
        return self._user.gid if self._user else None

    @property
    def _extra_groups(self) -> list[int] | None:
        # An empty list drops root's supplementary groups along with the uid/gid switch.
        return [] if self._user else None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "LC_"))}
        env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8")
        return env

    def _initdb(self) -> None:
        assert self._install is not None
        progress("initialising a PostgreSQL cluster")
        self._run_as_user(
            [
                str(self._install.bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
            timeout=120,
        )

    def _write_config(self) -> None:
        settings = dict(
            SERVER_SETTINGS,
            listen_addresses=f"'{','.join(sorted({'127.0.0.1', self.host}))}'",
            port=str(self.port),
            unix_socket_directories=f"'{self._workdir}'",
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# agent-dispatch test environment\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        # Trust, but only over the unix socket in our private directory and IPv4 loopback.
        (self.data_dir / "pg_hba.conf").write_text(
            f"local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all {self.clients} trust\n"
            "local replication all trust\n"
            "host replication all 127.0.0.1/32 trust\n"
        )

    def _launch(self) -> None:
        assert self._install is not None
        with self.log_path.open("ab") as out:
            # A new session keeps a Ctrl-C aimed at pytest from hitting the server before atexit does.
            self._proc = subprocess.Popen(
                [str(self._install.bindir / "postgres"), "-D", str(self.data_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._workdir,
                env=self._env(),
                start_new_session=True,
                user=self._uid,
                group=self._gid,
                extra_groups=self._extra_groups,
            )
        try:
            wait_until(
                self._accepts_connections,
                timeout=START_TIMEOUT_S,
                what=f"PostgreSQL on port {self.port}",
                log=self.log_path,
                proc=self._proc,
            )
        except ServiceUnavailable:
            self.stop(immediate=True)
            raise

    def _accepts_connections(self) -> bool:
        import psycopg

        with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)


def _checked_name(name: str) -> str:
    # Lower case only: the name is quoted in DDL but unquoted in DSNs and in most hand-written SQL.
    if not _DBNAME_RE.match(name):
        raise ValueError(f"invalid database name {name!r}: use a-z, 0-9 and _ (at most 63)")
    return name
