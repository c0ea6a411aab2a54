"""End-to-end fenced turns/s on PostgreSQL with 1, 2 and 4 worker *pods* on the real test node,
beside the same count of worker *processes* on the host, in the same run (same server, same
submitter, same settings): what running in a pod costs.

    python -m bench.node_bench --quick      # 1 run of 3,000 turns per figure
    python -m bench.node_bench --full       # median of 3 runs of 10,000 turns per figure

It starts the node (testenv/node.py), a PostgreSQL server on the node's veth, installs the chart
(the operator runs as a pod), and writes docs/benchmarks-node.md. Needs root, like the node tests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import ROOT, machine, median, say, scalar

DOC = ROOT / "docs" / "benchmarks-node.md"
NAMESPACE = "adx-bench"
RELEASE = "adx-bench"
KEY = "node-bench-signing-key-" + "k" * 24
CONCURRENCY = 4
REMAINING = "SELECT count(*) FROM agent_dispatch_work_items WHERE state IN ('submitted', 'ready', 'leased', 'running')"


def _env(dsn: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))
    }
    return {
        **base,
        "TASK_QUEUE_BACKEND": "postgres",
        "STATE_DB_URI": dsn,
        "AGENT_DISPATCH_SIGNING_KEY": KEY,
        "AGENT_DISPATCH_CONCURRENCY": str(CONCURRENCY),
        "AGENT_DISPATCH_EXECUTOR": "noop",
        "AGENT_DISPATCH_METRICS_PORT": "0",
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
    }


def _submit_and_drain(dsn: str, count: int, timeout: float = 900) -> float:
    """Submit ``count`` turns (batches of 100, the bench submitter) and return turns/s to drained."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench._ours", "insert", str(count), "100"],
        env=_env(dsn),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"submitter failed: {proc.stderr[-2000:]}")
    deadline = started + timeout
    while scalar(dsn, REMAINING) != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not drained within {timeout}s")
        time.sleep(0.05)
    return count / (time.monotonic() - started)


def _migrate(dsn: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "agent_dispatch.cli", "migrate"],
        env=_env(dsn),
        check=True,
        capture_output=True,
    )


def _host_round(dsn: str, workers: int, count: int) -> float:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "agent_dispatch.cli", "worker"],
            env={**_env(dsn), "AGENT_DISPATCH_WORKER_ID": f"host-{i}"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    try:
        time.sleep(3)  # started and listening, as the pods are Ready before their round
        return _submit_and_drain(dsn, count)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


#: Each worker pod's creation-to-Ready time (the image already on the node), for the doc.
READY_S: list[float] = []


def _seconds_to_ready(pod: dict[str, Any]) -> float:
    created = dt.datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    (ready,) = [c for c in pod["status"]["conditions"] if c["type"] == "Ready"]
    return (
        dt.datetime.fromisoformat(ready["lastTransitionTime"].replace("Z", "+00:00")) - created
    ).total_seconds()


def _pod_round(node: Any, dsn_for_pods: str, dsn: str, workers: int, count: int) -> float:
    name = "bench-pods"
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-conn", "namespace": NAMESPACE},
        "stringData": {"dsn": dsn_for_pods, "signing-key": KEY},
    }
    resource = {
        "apiVersion": "agentdispatch.io/v1alpha1",
        "kind": "AgentDispatch",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "backend": "postgres",
            "postgres": {"dsnSecretRef": {"name": f"{name}-conn", "key": "dsn"}},
            "signingKeySecretRef": {"name": f"{name}-conn", "key": "signing-key"},
            "worker": {
                "image": node.images.app_ref,
                "replicas": workers,
                "concurrency": CONCURRENCY,
                "executor": {"name": "noop"},
                "logLevel": "WARNING",
            },
        },
    }
    node.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [secret, resource]}),
    )
    try:
        node.kubectl("wait", "--for=create", f"deployment/{name}-worker", "-n", NAMESPACE, "--timeout=120s")
        node.kubectl(
            "rollout", "status", f"deployment/{name}-worker", "-n", NAMESPACE, "--timeout=300s", timeout=320
        )
        selector = f"agent-dispatch.io/instance={name}"
        pods = json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json").stdout)
        READY_S.extend(_seconds_to_ready(pod) for pod in pods["items"])
        return _submit_and_drain(dsn, count)
    finally:
        node.kubectl(
            "delete",
            "agentdispatch",
            name,
            "-n",
            NAMESPACE,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        node.kubectl(
            "wait",
            "--for=delete",
            "pods",
            "-l",
            f"agent-dispatch.io/instance={name}",
            "-n",
            NAMESPACE,
            "--timeout=120s",
            check=False,
            timeout=150,
        )


def run(runs: int, count: int) -> dict[str, Any]:
    from testenv.helm import ensure_helm, run_helm
    from testenv.node import NodeCluster
    from testenv.postgres import PostgresServer

    node = NodeCluster().start()
    server = PostgresServer(host=node.host_ip, clients=str(node.network.subnet)).start()
    helm_home = Path(tempfile.mkdtemp(prefix="bench-helm-"))
    results: dict[str, Any] = {"pods": {}, "host": {}, "count": count, "runs": runs}
    try:
        run_helm(
            "install",
            RELEASE,
            str(ROOT / "charts" / "agent-dispatch"),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "--wait",
            "--set",
            "rbac.secretNames={bench-pods-conn}",
            "--set",
            "metricsApi.enabled=false",
            helm=ensure_helm(),
            home=helm_home,
            kubeconfig=node.kubeconfig,
            timeout=400,
        )
        for workers in (1, 2, 4):
            for where in ("host", "pods"):
                rates = []
                for attempt in range(runs):
                    db = f"bench_{where}_{workers}_{attempt}_{uuid.uuid4().hex[:6]}"
                    dsn = server.create_database(db)
                    _migrate(dsn)
                    rate = (
                        _pod_round(node, dsn, dsn, workers, count)
                        if where == "pods"
                        else _host_round(dsn, workers, count)
                    )
                    server.drop_database(db)
                    say(f"{where} x{workers}: {rate:,.0f} turns/s")
                    rates.append(rate)
                results[where][workers] = median(rates)
    finally:
        server.close()
        node.stop()
    return results


def render(results: dict[str, Any], command: str) -> str:
    rows = "\n".join(
        f"| {w} | {results['host'][w]:,.0f} | {results['pods'][w]:,.0f} | {results['pods'][w] / results['host'][w]:.2f}x |"
        for w in (1, 2, 4)
    )
    info = machine()
    return f"""# Worker pods on a real node against worker processes on the host

Fenced no-op turns per second on PostgreSQL, end to end (submit in batches of 100, to every turn
committed and acknowledged), with the same number of workers ({CONCURRENCY} threads each) as pods on
the test node (`testenv/node.py`: kubelet, containerd, the image built from the Dockerfile, the
operator from the Helm chart) and as processes on the host, in the same run against the same
PostgreSQL server (on the node's veth). {results["count"]:,} turns per run, median of
{results["runs"]} run(s).

| workers | host processes (turns/s) | pods (turns/s) | pods / host |
| --- | --- | --- | --- |
{rows}

A worker pod took {median(READY_S) if READY_S else float("nan"):.0f} s from creation to Ready (median of
{len(READY_S)} pods; max {max(READY_S) if READY_S else float("nan"):.0f} s), the image already on the node.

Machine: {info.get("cpu_model", "")} ({info.get("cores", "")} cores, {info.get("memory_gib", "")} GiB), {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC.
Command: `{command}`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.node_bench")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="1 run of 3,000 turns per figure")
    mode.add_argument("--full", action="store_true", help="median of 3 runs of 10,000 turns")
    args = parser.parse_args(argv)
    runs, count = (3, 10_000) if args.full else (1, 3_000)
    results = run(runs, count)
    command = f"python -m bench.node_bench {'--full' if args.full else '--quick'}"
    DOC.write_text(render(results, command))
    say(f"wrote {DOC}")


if __name__ == "__main__":
    main()
