"""kube-apiserver restarts while the operator reconciles an AgentDispatch with live workers.

During the outages the world changes: a worker is SIGKILLed and another one starts (its first
heartbeat finds no API server). After the last restart the spec changes too. Then the status must
recover and match reality: the operator still runs, observedGeneration is the new generation,
the Deployment carries the new spec, the live and stale workers are exactly the running and the
killed processes, and Ready is True.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from testenv.kube import ControlPlane
from tests.chaos.kube_support import install_crd
from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.chaos, pytest.mark.kube]

IMAGE = "agent-dispatch:chaos"
INSTANCE = "steady"
TTL_S = 6
#: The operator refreshes status every 10 s; a loaded machine needs a few rounds after an outage.
RECOVER_S = 120


class Workers:
    """Worker processes that publish heartbeat Leases to the test API server."""

    def __init__(self, kube: ControlPlane, namespace: str, tmp_path: Path) -> None:
        self.kube = kube
        self.namespace = namespace
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def migrate(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "agent_dispatch.cli", "migrate"],
            env=self._env("migrate"),
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self, worker_id: str) -> None:
        env = self._env(worker_id)
        with (self.tmp / f"{worker_id}.log").open("ab") as log:
            self.procs[worker_id] = subprocess.Popen(
                [sys.executable, "-m", "agent_dispatch.cli", "worker"],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _env(self, worker_id: str) -> dict[str, str]:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
        }
        env = {
            **base,
            **self.kube.env,
            "TASK_QUEUE_BACKEND": "sqlite",
            "AGENT_DISPATCH_DATA_DIR": str(self.tmp / "data"),
            "AGENT_DISPATCH_CLAIM_TTL_S": str(TTL_S),
            "AGENT_DISPATCH_RENEW_INTERVAL_S": "2",
            "AGENT_DISPATCH_SIGNING_KEY": "s" * 40,
            "AGENT_DISPATCH_METRICS_PORT": "0",
            "AGENT_DISPATCH_INSTANCE": INSTANCE,
            "AGENT_DISPATCH_NAMESPACE": self.namespace,
            "AGENT_DISPATCH_WORKER_ID": worker_id,
            "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
        }
        return env

    def kill(self, worker_id: str) -> None:
        proc = self.procs[worker_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def running(self) -> list[str]:
        return sorted(w for w, p in self.procs.items() if p.poll() is None)

    def tail(self, worker_id: str) -> str:
        return (self.tmp / f"{worker_id}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def workers(kube: ControlPlane, kube_namespace: str, tmp_path: Path) -> Iterator[Workers]:
    group = Workers(kube, kube_namespace, tmp_path)
    yield group
    group.stop()


def read_ad(kube_api: client.ApiClient, namespace: str) -> dict[str, Any] | None:
    from tests.kube.conftest import get_ad

    try:
        return get_ad(kube_api, namespace, INSTANCE)
    except Exception:  # the API server is down or just back: ask again
        return None


def test_apiserver_restarts_status_recovers_and_matches_reality(
    kube: ControlPlane,
    kube_api: client.ApiClient,
    kube_namespace: str,
    workers: Workers,
    tmp_path: Path,
    chaos_seed: int,
    chaos_duration: float,
) -> None:
    from tests.kube.conftest import OperatorProcess, agentdispatch, condition, kubectl_apply, wait_for

    rng = random.Random(f"{chaos_seed}/operator")
    ns = kube_namespace
    install_crd(kube)
    operator = OperatorProcess(kube, ns, tmp_path).start()
    try:
        spec: dict[str, Any] = {
            "backend": "sqlite",
            "claimTtlSeconds": TTL_S,
            "renewIntervalSeconds": 2,
            "maxDepth": 100,
            "worker": {"image": IMAGE},
        }
        kubectl_apply(kube, ns, agentdispatch(INSTANCE, spec))
        workers.migrate()
        workers.start("w-1")
        workers.start("w-2")

        def live_ids() -> list[str]:
            status = (read_ad(kube_api, ns) or {}).get("status") or {}
            return list((status.get("workers") or {}).get("liveIds") or [])

        wait_for(lambda: live_ids() == ["w-1", "w-2"], RECOVER_S, interval=1, what="two live workers")

        # -- faults: the API server goes away and comes back, several times -------------------
        restarts = max(1, int(chaos_duration // 30))
        log: list[dict[str, Any]] = []
        for n in range(restarts):
            time.sleep(rng.uniform(1.0, 5.0))
            down = round(rng.uniform(2.0, 8.0), 2)
            kube.stop_apiserver()
            if n == 0:
                # Reality changes while nobody can write it down: one worker dies, one starts.
                workers.kill("w-1")
                workers.start("w-3")
            time.sleep(down)
            kube.start_apiserver()
            log.append({"restart": n + 1, "down_s": down, "at": dt.datetime.now(dt.UTC).isoformat()})
            print(f"[chaos operator] seed={chaos_seed} {json.dumps(log[-1])}")
        last_restart = dt.datetime.now(dt.UTC).replace(microsecond=0)

        # A change after the outages must still be reconciled (the watch came back).
        spec["maxDepth"] = 200
        wait_for(
            lambda: kubectl_apply(kube, ns, agentdispatch(INSTANCE, spec), check=False).returncode == 0,
            60,
            what="the spec change accepted",
        )

        # -- status recovers and matches reality ----------------------------------------------
        def recovered() -> dict[str, Any] | None:
            ad = read_ad(kube_api, ns)
            if ad is None:
                return None
            status = ad.get("status") or {}
            stamp = status.get("lastReconcileTime") or ""
            found = status.get("workers") or {}
            if not (
                status.get("observedGeneration") == ad["metadata"]["generation"]
                and stamp
                and dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) >= last_restart
                and found.get("liveIds") == ["w-2", "w-3"]
                and found.get("staleIds") == ["w-1"]
                and condition(ad, "Ready").get("status") == "True"
            ):
                return None
            return ad

        try:
            ad = wait_for(recovered, RECOVER_S, interval=1, what="status recovered after the restarts")
        except AssertionError:
            detail = {w: (workers.procs[w].poll(), workers.tail(w)[-800:]) for w in workers.procs}
            raise AssertionError(
                f"seed {chaos_seed}, restarts {log}: status {json.dumps((read_ad(kube_api, ns) or {}).get('status'))}\n"
                f"workers {detail}\noperator log:\n{operator.tail()}"
            ) from None
        assert workers.running() == ["w-2", "w-3"], "the workers the status calls live are the running ones"
        assert condition(ad, "ConfigValid")["status"] == "True"
        assert condition(ad, "WorkersAvailable")["status"] == "True"
        assert ad["status"]["workers"]["live"] == 2 and ad["status"]["workers"]["stale"] == 1
        dep = client.AppsV1Api(kube_api).read_namespaced_deployment(f"{INSTANCE}-worker", ns)
        env = {e.name: e.value for e in dep.spec.template.spec.containers[0].env}
        assert env["AGENT_DISPATCH_MAX_DEPTH"] == "200", (
            "the change made after the outages reached the Deployment"
        )
        assert operator.proc is not None and operator.proc.poll() is None, "the operator survived"
        assert operator.liveness() is not None
    finally:
        kube.start_apiserver()  # never leave the shared API server down for the next test
        operator.stop()
