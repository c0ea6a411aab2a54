"""One AgentDispatch on the real node, driven as a user drives it: a Secret and the custom resource
applied with kubectl, the operator's worker pods, turns submitted through the gateway (on the host),
and every invariant checked against the store and the fencing sink afterwards."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent_dispatch.gateway import hash_token, write_tokens_file
from agent_dispatch.models import WorkItem, WorkState
from testenv._common import free_port, port_open
from testenv.node import NodeCluster
from tests.e2e.harness import BASE_ENV, KEY, ROOT, Backend, post_turn
from tests.e2e.sink import FencingSink
from tests.node._support import describe, failure, pods, ready

TENANT = "node-tests"
TOKEN = "node-token-" + "z" * 24
#: The claim TTL of the scaling tests' AgentDispatch objects: the product's default. It is also the
#: visibility timeout after which the recovery sweep looks at a ready turn again; on Kafka the sweep
#: asks the topic which turns still have a message queued (``KnowsQueued``) and re-drives only the
#: others, but a scan that times out on a busy machine re-drives all, and a second message per
#: waiting turn would keep the lag, the very signal under test, high after the backlog drained.
SCALING_CLAIM_TTL_S = 120
TERMINAL = {WorkState.SUCCEEDED, WorkState.FAILED, WorkState.CANCELLED, WorkState.DEAD_LETTER}


class PodDispatch:
    """An AgentDispatch named ``name`` in ``namespace`` on ``backend`` (postgres or kafka)."""

    def __init__(
        self,
        node: NodeCluster,
        namespace: str,
        name: str,
        backend: str,
        *,
        dsn: str,
        sink_url: str,
        tmp_path: Path,
        kafka_bootstrap: str | None = None,
        replicas: int = 2,
        extra_spec: dict[str, Any] | None = None,
        claim_ttl_s: int = 20,
    ) -> None:
        """``claim_ttl_s``: short by default, so a killed worker's turns come back quickly."""
        from tests.node.conftest import DISPATCH_NAMES

        assert name in DISPATCH_NAMES, (
            f"add {name!r} to DISPATCH_NAMES (the operator reads only listed Secrets)"
        )
        self.node, self.namespace, self.name, self.backend = node, namespace, name, backend
        self.topic = f"turns-{name}"
        self.env = {
            "TASK_QUEUE_BACKEND": backend,
            "STATE_DB_URI": dsn,
            "AGENT_DISPATCH_SIGNING_KEY": KEY,
            "AGENT_DISPATCH_CLAIM_TTL_S": str(claim_ttl_s),
            "AGENT_DISPATCH_RENEW_INTERVAL_S": "2",
            "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"),
        }
        spec: dict[str, Any] = {
            "backend": backend,
            "partitions": 4,
            "claimTtlSeconds": claim_ttl_s,
            "renewIntervalSeconds": 2,
            "sweepIntervalSeconds": 2,
            "postgres": {"dsnSecretRef": {"name": f"{name}-conn", "key": "dsn"}},
            "signingKeySecretRef": {"name": f"{name}-conn", "key": "signing-key"},
            "worker": {
                "image": node.images.app_ref if node.images else "agent-dispatch:0.1.0",
                "replicas": replicas,
                "concurrency": 2,
                "shutdownGraceSeconds": 10,
                "executor": {"name": "http", "url": sink_url, "timeoutSeconds": 60},
            },
        }
        if backend == "kafka":
            assert kafka_bootstrap is not None
            spec["kafka"] = {"bootstrapServers": kafka_bootstrap, "topic": self.topic}
            self.env.update(
                KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
                AGENT_DISPATCH_KAFKA_TOPIC=self.topic,
                AGENT_TURNS_PARTITIONS="4",
            )
        spec.update(extra_spec or {})
        self.spec = spec
        self.tmp_path = tmp_path
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_port = 0
        self.gateway_log = tmp_path / f"gateway-{name}.log"
        self.accepted: list[str] = []
        self.last_refusal = ""
        #: Every refusal the gateway gave (monotonic time, "status body"): what a slow start shows.
        self.refusals: list[tuple[float, str]] = []
        self.backend_handle = Backend(backend, self.env)
        self._store: Any = None

    # -- cluster side ------------------------------------------------------------------------------

    def apply(self) -> PodDispatch:
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{self.name}-conn", "namespace": self.namespace},
            "stringData": {"dsn": self.env["STATE_DB_URI"], "signing-key": KEY},
        }
        resource = {
            "apiVersion": "agentdispatch.io/v1alpha1",
            "kind": "AgentDispatch",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": self.spec,
        }
        self.node.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [secret, resource]}),
        )
        return self

    @property
    def selector(self) -> str:
        return f"agent-dispatch.io/instance={self.name}"

    def worker_pods(self) -> list[dict[str, Any]]:
        return pods(self.node, self.namespace, self.selector)

    def wait_ready_workers(self, count: int, timeout: float = 180) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p in self.worker_pods() if ready(p) and not p["metadata"].get("deletionTimestamp")]
            if len(live) >= count:
                return live
            time.sleep(1)
        raise failure(
            f"{count} Ready worker pods of {self.name} not there after {timeout}s",
            describe(self.node, self.namespace),
        )

    def wait_reconciled(self, timeout: float = 120) -> None:
        """The operator has migrated the schema and reached the transport (what a user waits for)."""
        out = self.node.kubectl(
            "wait",
            "--for=condition=TransportReachable",
            f"agentdispatch/{self.name}",
            "-n",
            self.namespace,
            f"--timeout={int(timeout)}s",
            check=False,
            timeout=timeout + 30,
        )
        status = self.node.kubectl(
            "get", "agentdispatch", self.name, "-n", self.namespace, "-o", "jsonpath={.status}", check=False
        ).stdout
        assert out.returncode == 0, (
            f"{out.stdout}{out.stderr}\n{status}\n{describe(self.node, self.namespace)}"
        )

    def delete(self) -> None:
        self.node.kubectl(
            "delete",
            "agentdispatch",
            self.name,
            "-n",
            self.namespace,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )

    # -- gateway on the host -----------------------------------------------------------------------

    def start_gateway(self) -> None:
        self.wait_reconciled()
        tokens = self.tmp_path / f"tokens-{self.name}.yaml"
        write_tokens_file(tokens, {TENANT: [hash_token(TOKEN)]})
        self.gateway_port = free_port()
        env = {
            **BASE_ENV,
            **self.env,
            "AGENT_DISPATCH_TOKENS_FILE": str(tokens),
            "PYTHONPATH": str(ROOT),
            "AGENT_DISPATCH_METRICS_PORT": "0",
        }
        with self.gateway_log.open("ab") as out:
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "agent_dispatch.cli", "gateway", "--port", str(self.gateway_port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while not port_open(self.gateway_port):
            assert self.gateway.poll() is None, self.gateway_log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.gateway_log.read_text()[-3000:]
            time.sleep(0.2)

    def submit(self, count: int, *, sleep_s: float = 0.0, sessions: int = 8, parallel: int = 1) -> list[str]:
        """POST ``count`` turns through the gateway; returns the accepted job ids, in order.

        ``parallel`` requests at a time (clients of a backlog do not queue behind one another; one
        at a time, a loaded machine took a minute for 60 turns, and the backlog drained meanwhile).
        Turns of one session are submitted in order only with ``parallel=1``.
        """

        def one(index: int) -> str:
            body = {"kind": "node", "session_id": f"s{index % sessions}", "payload": {"sleep_s": sleep_s}}
            key = f"{self.name}-{uuid.uuid4().hex}"
            for _attempt in range(30):
                status, answer = self._post(body, key)
                if status in (200, 201, 202):
                    return str(answer["job_id"])
                time.sleep(0.5)  # 429/503/unreachable: retry the same key
            raise AssertionError(
                f"turn {index} never accepted ({self.last_refusal}); gateway log:\n{self.gateway_log.read_text()[-2000:]}"
            )

        if parallel <= 1:
            ids = [one(index) for index in range(count)]
        else:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                ids = list(pool.map(one, range(count)))
        self.accepted += ids
        return ids

    def _post(self, body: dict[str, Any], key: str) -> tuple[int | None, dict[str, Any]]:
        answer = post_turn(self.gateway_port, TOKEN, body, key, timeout_s=15)
        if answer.refusal is not None:
            self.refusals.append((time.monotonic(), answer.refusal))
            if answer.status is not None:
                self.last_refusal = answer.refusal
        return answer.status, answer.handle

    # -- outcomes ------------------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        if self._store is None:
            _settings, self._store, transport = self.backend_handle.open()
            transport.close()
        return self._store

    def items(self, ids: list[str]) -> dict[str, WorkItem]:
        found: dict[str, WorkItem] = {}
        for job in ids:
            found[job] = self.store.get(job)
        return found

    def wait_terminal(self, ids: list[str], timeout: float) -> dict[str, WorkItem]:
        deadline = time.monotonic() + timeout
        items: dict[str, WorkItem] = {}
        while time.monotonic() < deadline:
            items = self.items(ids)
            if all(item.state in TERMINAL for item in items.values()):
                return items
            time.sleep(1)
        pending = [job for job, item in items.items() if item.state not in TERMINAL]
        raise failure(
            f"{len(pending)} turns not terminal after {timeout}s, e.g. {pending[:3]}",
            describe(self.node, self.namespace),
        )

    def violations(self, ids: list[str], sink: FencingSink) -> list[str]:
        """Each accepted turn succeeded exactly once, with the sink's highest token as its commit's."""
        found: list[str] = []
        for job, item in self.items(ids).items():
            records = self.store.outcomes(item.id)
            commits = [r for r in records if r.event == "commit"]
            succeeded = [r for r in commits if r.outcome == "succeeded"]
            if item.state is not WorkState.SUCCEEDED:
                found.append(f"{job}: ended {item.state.value}")
                continue
            if len(succeeded) != 1 or len(commits) != 1:
                found.append(f"{job}: {len(commits)} terminal commits, {len(succeeded)} succeeded")
            if sink.highest.get(job) != item.fencing_token:
                found.append(
                    f"{job}: committed token {item.fencing_token}, sink's highest {sink.highest.get(job)}"
                )
            if any(token > item.fencing_token for token in sink.refused.get(job, [])):
                found.append(f"{job}: the sink refused a token above the committed one")
        return found

    def close(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.gateway.wait(20)
            if self.gateway.poll() is None:
                self.gateway.kill()
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
        self.delete()


def pod_env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
