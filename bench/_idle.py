"""Idle behaviour: dispatch latency to idle workers, idle CPU, resident memory of each process."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench._common import (
    BASE_ENV,
    KEY,
    ROOT,
    children_of,
    cpu_seconds,
    percentile,
    python_cmd,
    rss_mib,
    say,
    spawn,
)
from bench._e2e import Databases, OursDriver


def _postmaster_pid(server: Any) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((Path(server.data_dir) / "postmaster.pid").read_text().splitlines()[0])
    return None


def _server_cpu(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    total = 0.0
    for child in [pid, *children_of(pid)]:
        with contextlib.suppress(OSError):
            total += cpu_seconds(child)
    return total


def dispatch_and_idle(server: Any, *, samples: int, idle_s: float, log_dir: Path) -> dict[str, Any]:
    """One idle worker process on PostgreSQL: submit-to-start latency, then idle CPU and RSS."""
    from agent_dispatch import dispatch
    from agent_dispatch.models import SubmitRequest
    from agent_dispatch.stores import open_store
    from agent_dispatch.transports import open_transport

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(10)
    driver = OursDriver("postgres", Databases(server))
    driver.prepare()
    driver.env["AGENT_DISPATCH_EXECUTOR"] = "bench._ours:probe"
    driver.env["AGENT_DISPATCH_BENCH_PROBE"] = str(sock.getsockname()[1])
    settings = driver._settings()
    store = open_store(settings)
    transport = open_transport(settings)
    admission = dispatch.choose_admission(store, transport, signing_key=KEY.encode(), settings=settings)
    worker = driver.start_worker(0, log_dir)
    result: dict[str, Any] = {}
    try:
        driver.wait_ready(worker)
        time.sleep(2)
        latencies: list[float] = []
        submits: list[float] = []  # the enqueue call, to its commit
        for i in range(samples + 5):
            time.sleep(random.uniform(0.2, 0.4))  # the worker's claim loops are back to waiting
            request = SubmitRequest(tenant="latency", kind="probe", payload=b"{}", idempotency_key=f"l{i}")
            submitted = time.time()
            item = admission.enqueue(request).item
            returned = time.time()
            while True:
                job, started = sock.recv(200).decode().split()
                if job == item.id:
                    break
            if i >= 5:  # warm-up
                latencies.append(float(started) - submitted)
                submits.append(returned - submitted)
        result["dispatch_p50_ms"] = percentile(latencies, 0.5) * 1e3
        result["dispatch_p99_ms"] = percentile(latencies, 0.99) * 1e3
        result["dispatch_submit_p50_ms"] = percentile(submits, 0.5) * 1e3
        result["dispatch_samples"] = len(latencies)
        say(
            f"dispatch latency: p50 {result['dispatch_p50_ms']:.1f} ms  p99 {result['dispatch_p99_ms']:.1f} ms "
            f"(the submit call itself: p50 {result['dispatch_submit_p50_ms']:.1f} ms)"
        )

        time.sleep(3)
        postmaster = _postmaster_pid(server)
        cpu0, server0, t0 = cpu_seconds(worker.pid), _server_cpu(postmaster), time.monotonic()
        time.sleep(idle_s)
        cpu1, server1, t1 = cpu_seconds(worker.pid), _server_cpu(postmaster), time.monotonic()
        result["idle_cpu_pct"] = 100 * (cpu1 - cpu0) / (t1 - t0)
        result["idle_server_cpu_pct"] = 100 * (server1 - server0) / (t1 - t0)
        result["idle_window_s"] = t1 - t0
        result["worker_rss_mib"] = rss_mib(worker.pid)
        say(
            f"idle worker: {result['idle_cpu_pct']:.2f}% of a core over {t1 - t0:.0f}s "
            f"(PostgreSQL, all sessions: {result['idle_server_cpu_pct']:.2f}%), RSS {result['worker_rss_mib']:.0f} MiB"
        )
    finally:
        worker.stop()
        transport.close()
        store.close()
        sock.close()
        driver.cleanup()
    return result


def gateway_rss(server: Any, log_dir: Path) -> dict[str, Any]:
    """``agent-dispatch gateway`` on PostgreSQL, idle: resident memory after it serves."""
    from agent_dispatch.gateway import hash_token, new_token, write_tokens_file

    driver = OursDriver("postgres", Databases(server))
    driver.prepare()
    tokens = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-")) / "tokens.yaml"
    write_tokens_file(tokens, {"bench": [hash_token(new_token())]})
    proc = spawn(
        "gateway",
        python_cmd("-m", "agent_dispatch.cli", "gateway", "--port", "0"),
        env={**driver.env, "AGENT_DISPATCH_TOKENS_FILE": str(tokens), "AGENT_DISPATCH_METRICS_PORT": "0"},
        log_dir=log_dir,
    )
    try:
        line = proc.wait_line("agent-dispatch gateway: serving on", 120)
        url = line.rsplit(" ", 1)[1]
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/openapi.json", timeout=5).read()  # one request served
        time.sleep(3)
        rss = rss_mib(proc.pid)
        say(f"gateway RSS {rss:.0f} MiB")
        return {"gateway_rss_mib": rss}
    finally:
        proc.stop()
        driver.cleanup()


def operator_rss(log_dir: Path) -> dict[str, Any]:
    """The kopf operator watching one namespace of a real kube-apiserver (testenv), idle."""
    from testenv._common import free_port
    from testenv.kube import ControlPlane

    kube = ControlPlane()
    try:
        kube.start()
        kube.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "agentdispatch.yaml"))
        namespace = f"bench-{uuid.uuid4().hex[:6]}"
        kube.kubectl("create", "namespace", namespace)
        port = free_port()
        env = {
            **BASE_ENV,
            **kube.env,
            "AGENT_DISPATCH_METRICS_PORT": "0",
            "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
        }
        proc = spawn(
            "operator",
            python_cmd(
                "-m",
                "agent_dispatch.cli",
                "operator",
                "-n",
                namespace,
                "--liveness",
                f"http://127.0.0.1:{port}/healthz",
            ),
            env=env,
            log_dir=log_dir,
        )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"operator exited {proc.popen.returncode}:\n{proc.tail()}")
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp,
                ):
                    if resp.status == 200:
                        break
                time.sleep(0.5)
            else:
                raise RuntimeError("operator not healthy within 120s")
            time.sleep(5)
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(10)
            cpu = 100 * (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
            rss = rss_mib(proc.pid)
            say(f"operator RSS {rss:.0f} MiB, idle CPU {cpu:.2f}%")
            return {"operator_rss_mib": rss, "operator_idle_cpu_pct": cpu, "kube_version": kube.version}
        finally:
            proc.stop()
    finally:
        kube.stop()


def main() -> None:  # pragma: no cover - manual use: python -m bench._idle
    from testenv.postgres import PostgresServer

    with PostgresServer() as server:
        out = dispatch_and_idle(server, samples=20, idle_s=5, log_dir=Path(tempfile.mkdtemp()))
        out.update(gateway_rss(server, Path(tempfile.mkdtemp())))
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
