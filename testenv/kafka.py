"""A throwaway Apache Kafka node (KRaft, broker+controller in one JVM) on loopback.

The broker's jars come from Maven Central through Maven into the project's cache (once per
version); the node runs with the machine's Java from a temporary directory on free ports.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from testenv._common import (
    LoopbackService,
    ServiceUnavailable,
    cache_dir,
    free_port,
    log_tail,
    port_open,
    progress,
    run_logged,
    wait_until,
)

# 4.x brokers need Java 17, which this machine has; bump deliberately, the cache is keyed by version.
KAFKA_VERSION = "4.3.2"
SCALA_VERSION = "2.13"
# Kafka logs through slf4j 1.7 into log4j2; this binding matches the log4j2 release Kafka ships with.
LOG4J_VERSION = "2.24.3"
DEPENDENCY_PLUGIN_VERSION = "3.8.1"
INSTALL_TIMEOUT_S = 900
# Generous: on the shared 2-core test machine, with other test runs pushing the load average
# past 100, a broker was seen to need more than 90 s to serve (it is only waited for, never slow
# when the machine is quiet).
START_TIMEOUT_S = 240
JVM_OPTS = (
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>agent-dispatch.testenv</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>{kafka}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_{scala}</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
    </dependency>
  </dependencies>
  <build>
    <pluginManagement>
      <plugins>
        <plugin>
          <groupId>org.apache.maven.plugins</groupId>
          <artifactId>maven-dependency-plugin</artifactId>
          <version>{plugin}</version>
        </plugin>
      </plugins>
    </pluginManagement>
  </build>
</project>
"""

_LOG4J2 = """status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
# Per-request and per-segment chatter buries the lines that explain a failure in the log tail.
logger.kafkaLog.name = kafka.log
logger.kafkaLog.level = WARN
logger.storageLog.name = org.apache.kafka.storage
logger.storageLog.level = WARN
"""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ServiceUnavailable(f"{name} is not on PATH; the Kafka test broker needs Java 17+ and Maven")
    return path


@contextlib.contextmanager
def _install_lock(root: Path, timeout: float = INSTALL_TIMEOUT_S + 60) -> Iterator[TextIO]:
    """Serialise installs of one version across processes (pytest-xdist workers, parallel CI steps)."""
    with (root / ".lock").open("w") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(
                        f"timed out waiting for another Kafka install ({root})"
                    ) from None
                time.sleep(1)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _broker_jar(libs: Path, version: str) -> Path:
    return libs / f"kafka_{SCALA_VERSION}-{version}.jar"


def ensure_installed(version: str = KAFKA_VERSION) -> Path:
    """Directory holding every jar the broker needs, resolved with Maven once per version."""
    root = cache_dir("kafka", version)
    libs, marker = root / "libs", root / ".complete"
    if marker.is_file() and _broker_jar(libs, version).is_file():
        return libs
    with _install_lock(root):
        if marker.is_file() and _broker_jar(libs, version).is_file():
            return libs  # another process finished while we waited
        _resolve_jars(root, version)
        marker.write_text(version + "\n")
    return libs


def _resolve_jars(root: Path, version: str) -> None:
    progress(f"resolving Apache Kafka {version} broker jars with Maven (once per version)")
    pom = root / "pom.xml"
    pom.write_text(
        _POM.format(kafka=version, scala=SCALA_VERSION, log4j=LOG4J_VERSION, plugin=DEPENDENCY_PLUGIN_VERSION)
    )
    staging, libs = root / "libs.partial", root / "libs"
    shutil.rmtree(staging, ignore_errors=True)
    # Copy into a staging directory and rename, so an interrupted run never looks installed.
    run_logged(
        [
            _tool("mvn"),
            "-B",
            "-q",
            "-f",
            pom,
            "dependency:copy-dependencies",
            f"-DoutputDirectory={staging}",
            "-DincludeScope=runtime",
        ],
        root / "install.log",
        cwd=root,
        timeout=INSTALL_TIMEOUT_S,
    )
    if not _broker_jar(staging, version).is_file():
        raise ServiceUnavailable(
            f"Maven finished but {_broker_jar(staging, version).name} is missing\n"
            f"{log_tail(root / 'install.log')}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)


def _random_cluster_id() -> str:
    """A Kafka Uuid in its base64url text form; never starting with '-', which would parse as an option."""
    while True:
        text = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        if text[0].isalnum():
            return text


def _quiet_logger() -> logging.Logger:
    # librdkafka reports every refused connection; during start-up those are expected noise.
    logger = logging.getLogger("testenv.kafka.probe")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


class KafkaBroker(LoopbackService):
    """One KRaft node on 127.0.0.1: `start()` it, hand `bootstrap` to tests, `stop()` or `restart()` it."""

    NAME = "Kafka broker"
    # Controlled shutdown; a crash is SIGKILL (the base class's defaults, stated for the reader).
    STOP_SIGNAL = signal.SIGTERM
    CRASH_SIGNAL = signal.SIGKILL

    def __init__(
        self,
        version: str = KAFKA_VERSION,
        *,
        extra_config: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        node_id: int = 1,
        heap: tuple[str, ...] = JVM_OPTS,
    ) -> None:
        """``host``: the address clients use (loopback, or the host end of a test node's veth).

        ``node_id`` and ``heap`` are for the nodes of a :class:`testenv.kafka_cluster.KafkaCluster`,
        which also sets the ports, the voters and the cluster id before the first start.
        """
        super().__init__()
        self.host = host
        self.kafka_version = version
        self.version = f"Apache Kafka {version}"
        self.node_id = node_id
        self.port = 0
        self.controller_port = 0
        #: ``id@host:port`` of every controller; None: this node alone.
        self.voters: str | None = None
        self.cluster_id: str | None = None
        self._heap = heap
        self._extra_config = dict(extra_config or {})
        self._libs: Path | None = None

    # -- public attributes ------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._workdir / "kafka.log"

    # -- internals ---------------------------------------------------------------------------

    @property
    def _workdir(self) -> Path:
        if self._root is None:
            raise ServiceUnavailable("Kafka broker has not been started")
        return self._root

    def _prepare(self) -> None:
        self._libs = ensure_installed(self.kafka_version)
        self._root = Path(tempfile.mkdtemp(prefix="agent-dispatch-kafka-"))
        self._stop_at_exit()
        if self.voters is None:  # a cluster's nodes have their ports chosen by the cluster
            self.port, self.controller_port = free_port(), free_port()
        (self._workdir / "server.properties").write_text(self._server_properties())
        (self._workdir / "log4j2.properties").write_text(_LOG4J2)
        self._format_storage()

    def _server_properties(self) -> str:
        broker, controller = f"{self.host}:{self.port}", f"127.0.0.1:{self.controller_port}"
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            # A static voter set needs no --standalone/--initial-controllers at format time.
            "controller.quorum.voters": self.voters or f"{self.node_id}@{controller}",
            "listeners": f"PLAINTEXT://{broker},CONTROLLER://{controller}",
            "advertised.listeners": f"PLAINTEXT://{broker}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self._workdir / "logs"),
            # One node: every internal topic must be satisfiable with a single replica.
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # One partition per internal topic makes the first consumer group / transaction fast.
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.num.partitions": "1",
            "group.initial.rebalance.delay.ms": "0",
            # After a crash (restart(immediate=True)) the controller refuses the new incarnation until
            # the old registration's session expires: 9 s by default, a few seconds here.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "1000",
            # Lets tests use short classic-protocol session timeouts to provoke rebalances quickly.
            "group.min.session.timeout.ms": "1000",
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            **self._extra_config,
        }
        return "".join(f"{key}={value}\n" for key, value in settings.items())

    def _java(self, main: str, *args: str, heap: tuple[str, ...] | None = None) -> list[str]:
        return [
            _tool("java"),
            *(self._heap if heap is None else heap),
            f"-Dlog4j2.configurationFile={self._workdir / 'log4j2.properties'}",
            f"@{self._classpath_file()}",
            main,
            *args,
        ]

    def _classpath_file(self) -> Path:
        """A java @argfile with the class path: keeps the logged command line short enough to read."""
        assert self._libs is not None
        path = self._workdir / "classpath.args"
        if not path.is_file():
            # Explicit and sorted, because a '*' wildcard expands in no defined order.
            classpath = os.pathsep.join(str(jar) for jar in sorted(self._libs.glob("*.jar")))
            path.write_text(f'-cp "{classpath}"\n')
        return path

    def _format_storage(self) -> None:
        cmd = self._java(
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            self.cluster_id or _random_cluster_id(),
            "--config",
            str(self._workdir / "server.properties"),
            heap=("-Xmx256m", "-XX:TieredStopAtLevel=1"),
        )
        try:
            run_logged(cmd, self.log_path, cwd=self._workdir, timeout=120)
        except ServiceUnavailable as exc:
            raise ServiceUnavailable(f"Kafka storage format failed: {exc}") from exc

    def _launch(self) -> None:
        self.spawn()
        self.wait_serving()

    def spawn(self) -> None:
        """Start the JVM without waiting: a cluster's nodes serve only once a quorum of them runs."""
        with self.log_path.open("ab") as out:
            # A new session keeps a Ctrl-C aimed at pytest from hitting the JVM before atexit does.
            self._proc = subprocess.Popen(
                self._java("kafka.Kafka", str(self._workdir / "server.properties")),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._workdir,
                start_new_session=True,
            )

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until this node is a registered, unfenced broker; a node that never gets there is killed."""
        assert self._proc is not None
        try:
            wait_until(
                self._serves_metadata,
                timeout=timeout,
                what=f"Kafka broker on {self.bootstrap}",
                log=self.log_path,
                proc=self._proc,
                interval=0.25,
            )
        except ServiceUnavailable:
            self.stop(immediate=True)
            raise

    def _serves_metadata(self) -> bool:
        # Probe the socket first: an AdminClient against a closed port only retries and logs.
        if not port_open(self.port, self.host):
            return False
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "logger": _quiet_logger(),
            "socket.connection.setup.timeout.ms": 2000,
        }
        admin = AdminClient(conf)
        metadata = admin.list_topics(timeout=3)
        # The node is usable once it has registered itself as an (unfenced) broker.
        return self.node_id in metadata.brokers

    # -- faults a cluster test injects into one node ---------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a network partition, seen
        from its peers and clients, without touching the machine's network)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.send_signal(signal.SIGCONT)

    def stop(self, *, immediate: bool = False) -> None:
        # A paused JVM would sit out SIGTERM until the stop timeout: let it run to act on it.
        self.resume()
        super().stop(immediate=immediate)
