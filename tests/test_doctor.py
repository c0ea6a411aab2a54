"""The doctor reports lease recovery and never leaks hostnames, usernames or paths."""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch import doctor
from agent_dispatch.settings import load
from agent_dispatch.store import SCHEMA_VERSION
from testenv.postgres import PostgresServer

BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


def run_doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_dispatch.cli", "doctor", *args],
        env={**BASE_ENV, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_lease_recovery_reports_ttl_renew_and_rto() -> None:
    check = doctor.lease_recovery(load(AGENT_DISPATCH_CLAIM_TTL_S=90, AGENT_DISPATCH_RENEW_INTERVAL_S=20))
    assert check.name == "dispatch_lease_recovery"
    assert check.status == "ok"
    assert check.data["claim_ttl_s"] == 90
    assert check.data["renew_interval_s"] == 20
    assert check.data["rto_s"] == 300
    assert check.data["worst_case_recovery_s"] == 105


def test_lease_recovery_warns_when_sweep_pushes_past_rto() -> None:
    check = doctor.lease_recovery(load(AGENT_DISPATCH_CLAIM_TTL_S=300, AGENT_DISPATCH_SWEEP_INTERVAL_S=60))
    assert check.status == "warn"
    assert "exceeds the 300s RTO" in check.detail


def test_doctor_cli_table_and_json(tmp_path: Path) -> None:
    # A data directory of its own: the user's default one may hold a database in any state.
    own = {"AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data")}
    proc = run_doctor({**own, "AGENT_DISPATCH_SIGNING_KEY": "k" * 40})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dispatch_lease_recovery  ok" in proc.stdout
    proc = run_doctor(own, "--json")
    report = json.loads(proc.stdout)
    names = {c["name"]: c for c in report["checks"]}
    assert names["dispatch_lease_recovery"]["data"]["rto_s"] == 300
    assert names["signing_key"]["status"] == "warn"
    assert report["status"] == "warn"


SECRETS = {
    "STATE_DB_URI": "postgresql://alice-dbuser:pw@pg-secret-host.corp.example:5432/agents",
    "KAFKA_BOOTSTRAP_SERVERS": "kafka-secret-1.corp.example:9092,kafka-secret-2:9093",
    "AGENT_DISPATCH_DATA_DIR": "/srv/secret-tenant-dir/data",
    "TASK_QUEUE_BACKEND": "kafka",
}


@pytest.mark.parametrize("fmt", [(), ("--json",)])
def test_doctor_redacts_hosts_users_and_paths(fmt: tuple[str, ...]) -> None:
    proc = run_doctor(SECRETS, *fmt)
    out = proc.stdout + proc.stderr
    assert "dispatch_lease_recovery" in out
    for needle in [
        "alice-dbuser",
        "pg-secret-host",
        "kafka-secret-1",
        "kafka-secret-2",
        "corp.example",
        "/srv/secret-tenant-dir",
        "secret-tenant-dir",
        socket.gethostname(),
        getpass.getuser() if getpass.getuser() != "root" else "/root",
        os.path.expanduser("~"),
    ]:
        assert needle not in out, needle


def test_redact_scrubs_free_text() -> None:
    host = socket.gethostname()
    text = (
        f"connect to postgresql://bob@db.internal:5432/x failed on {host} "
        f"reading /home/bob/.config/agent-dispatch/tokens and kafka-1.internal:9092"
    )
    cleaned = doctor.redact(text)
    for needle in ["bob", "db.internal", host, "/home", "kafka-1.internal"]:
        assert needle not in cleaned
    assert "postgresql://<redacted>" in cleaned


# --- live probes -----------------------------------------------------------------------------


def _checks(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def test_doctor_probes_a_local_install_and_hides_its_paths(tmp_path: Path) -> None:
    data_dir = tmp_path / "secret-data-dir-4711"
    env = {
        "AGENT_DISPATCH_DATA_DIR": str(data_dir),
        "AGENT_DISPATCH_SIGNING_KEY": "k" * 40,
        "AGENT_DISPATCH_TOKENS_FILE": str(tmp_path / "secret-tokens-dir" / "tokens.yaml"),
        "KUBECONFIG": str(tmp_path / "secret-kube-home" / "config"),
    }
    before = run_doctor(env, "--json")
    assert _checks(before)["transport"]["status"] == "warn"  # nothing created by looking
    assert not data_dir.exists()

    migrate = subprocess.run(
        [sys.executable, "-m", "agent_dispatch.cli", "migrate"],
        env={**BASE_ENV, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stderr
    proc = run_doctor(env, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = _checks(proc)
    assert checks["transport"]["status"] == "ok"
    assert checks["transport"]["data"] == {
        "backend": "sqlite",
        "depth": 0,
        "max_depth": 100_000,
        "utilisation": 0.0,
        "partitions": 6,
    }
    assert checks["schema"]["status"] == "ok" and "current" in str(checks["schema"]["detail"])
    # The store's count of unfinished turns against the bound (what admission compares, every backend).
    assert checks["schema"]["data"] == {"version": SCHEMA_VERSION, "unfinished": 0, "max_depth": 100_000}
    assert checks["signing_key"]["status"] == "ok"
    assert checks["worker_heartbeats"]["status"] == "ok"
    human = run_doctor(env)
    for out in (proc.stdout + proc.stderr, human.stdout + human.stderr):
        for needle in [str(tmp_path), "secret-data-dir-4711", "secret-tokens-dir", "secret-kube-home"]:
            assert needle not in out, needle


@pytest.mark.postgres
@pytest.mark.parametrize("fmt", [(), ("--json",)])
def test_doctor_against_a_real_postgres_hides_user_host_and_paths(
    postgres_server: PostgresServer, tmp_path: Path, fmt: tuple[str, ...]
) -> None:
    # A reachable server and a role that does not exist: the server's error names the role,
    # the driver's log names the host; neither may reach the output.
    host = socket.gethostname()
    env = {
        "STATE_DB_URI": f"postgresql://doctor-secret-role@{host}:{postgres_server.port}/secret_db_name",
        "TASK_QUEUE_BACKEND": "postgres",
        "AGENT_DISPATCH_SIGNING_KEY": "k" * 40,
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "secret-pg-data"),
    }
    proc = run_doctor(env, *fmt)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out  # the store and transport cannot be used: a service unreachable
    assert "<redacted>" in out
    for needle in [
        "doctor-secret-role",
        f"{host}:",
        f"'{host}'",
        f'"{host}"',
        "secret-pg-data",
        str(tmp_path),
    ]:
        assert needle not in out, needle


@pytest.mark.kube
def test_doctor_counts_worker_heartbeats_from_their_leases(
    kube_api: Any, kubeconfig: Path, kube_namespace: str
) -> None:
    from agent_dispatch.worker._heartbeat import LeaseHeartbeat

    settings = load(
        AGENT_DISPATCH_INSTANCE="orders",
        AGENT_DISPATCH_NAMESPACE=kube_namespace,
        KUBECONFIG=str(kubeconfig),
    )
    assert [c.status for c in doctor.heartbeat_probe(settings)] == ["warn"]  # no workers yet

    live = LeaseHeartbeat(kube_api, kube_namespace, "orders", "w-live", duration_s=60, interval_s=30)
    stale = LeaseHeartbeat(kube_api, kube_namespace, "orders", "w-stale", duration_s=1, interval_s=30)
    other = LeaseHeartbeat(kube_api, kube_namespace, "billing", "w-other", duration_s=60, interval_s=30)
    for heartbeat in (live, stale, other):
        heartbeat.beat()
    time.sleep(2.5)  # the 1 s lease of w-stale runs out
    [check] = doctor.heartbeat_probe(settings)
    assert check.status == "ok"
    assert check.data == {"live": 1, "stale": 1}  # another instance's workers do not count
    assert check.detail == "1 live workers, 1 stale"


@pytest.mark.parametrize("fmt", [(), ("--json",)])
def test_doctor_with_an_unreachable_database_exits_3(tmp_path: Path, fmt: tuple[str, ...]) -> None:
    """The README's exit code for an unreachable service, not 1 (a failure found)."""
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        "STATE_DB_URI": f"postgresql://nobody@127.0.0.1:{port}/nowhere?connect_timeout=2",
        "AGENT_DISPATCH_SIGNING_KEY": "k" * 40,
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path),
    }
    proc = run_doctor(env, *fmt)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    if fmt:
        report = json.loads(proc.stdout)
        failed = [c for c in report["checks"] if c["status"] == "fail"]
        assert failed and all(c["data"].get("unreachable") for c in failed), failed


def test_exit_code_of_a_report() -> None:
    ok = doctor.Check("a", "ok", "")
    assert doctor.exit_code([ok, doctor.Check("b", "warn", "")]) == 0
    assert doctor.exit_code([ok, doctor.Check("b", "fail", "")]) == 1
    down = doctor.Check("c", "fail", "", {"unreachable": True})
    assert doctor.exit_code([doctor.Check("b", "fail", ""), down]) == 3
