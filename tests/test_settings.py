"""Every setting: its default, each bound, and the one-line error with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_dispatch import settings as s

CLEAN = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in set(os.environ) - set(CLEAN):
        monkeypatch.delenv(key)


def load_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> s.Settings:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return s.load()


def test_defaults() -> None:
    cfg = s.load()
    assert cfg.backend is s.Backend.SQLITE and not cfg.backend_explicit
    assert cfg.partitions == 6
    assert cfg.max_depth == 100_000
    assert cfg.claim_ttl_s == 120
    assert cfg.renew_interval_s == 30
    assert cfg.effective_renew_interval_s == 30
    assert cfg.effective_visibility_timeout_s == 120
    assert cfg.sweep_interval_s == 15
    assert cfg.max_attempts == 5
    assert cfg.max_payload_bytes == 1024 * 1024
    assert cfg.state_db_uri is None and cfg.kafka_bootstrap_servers is None and cfg.signing_key is None
    assert cfg.kafka_topic == "agent_turns" and cfg.kafka_group == "agent-dispatch"
    assert cfg.data_dir.name == "agent-dispatch"
    assert cfg.sqlite_path.parent == cfg.data_dir
    assert cfg.log_level == "INFO" and cfg.log_format is s.LogFormat.JSON
    assert cfg.metrics_port == 9464
    assert cfg.concurrency == 4 and cfg.executor == "noop" and cfg.executor_url is None
    assert cfg.executor_timeout_s == 300 and cfg.shutdown_grace_s == 30
    assert cfg.instance is None and cfg.namespace is None and cfg.worker_id is None


def test_kubernetes_identity_from_downward_api(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_with(
        monkeypatch, POD_NAMESPACE="agents", POD_NAME="workers-7d9f-abcde", AGENT_DISPATCH_INSTANCE="prod"
    )
    assert (cfg.namespace, cfg.worker_id, cfg.instance) == ("agents", "workers-7d9f-abcde", "prod")


def test_plugin_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        load_with(monkeypatch, AGENT_DISPATCH_EXECUTOR="my_agents.turns:run").executor
        == "my_agents.turns:run"
    )


def test_backend_follows_state_db_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_with(monkeypatch, STATE_DB_URI="postgresql://db.internal/agents")
    assert cfg.backend is s.Backend.POSTGRES and not cfg.backend_explicit
    cfg = load_with(monkeypatch, TASK_QUEUE_BACKEND="sqlite")
    assert cfg.backend is s.Backend.SQLITE and cfg.backend_explicit


def test_kafka_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_with(monkeypatch, TASK_QUEUE_BACKEND="kafka", KAFKA_BOOTSTRAP_SERVERS="k1:9092, k2:9093")
    assert cfg.backend is s.Backend.KAFKA


def test_renew_is_capped_at_a_third_of_the_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_with(monkeypatch, AGENT_DISPATCH_CLAIM_TTL_S="30")
    # The default 30 s interval is not an error with a short TTL: the guard renews at TTL/3.
    assert cfg.effective_renew_interval_s == 10


def test_data_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = load_with(monkeypatch, AGENT_DISPATCH_DATA_DIR=str(tmp_path))
    assert cfg.sqlite_path == tmp_path / "agent-dispatch.sqlite3"


# (variable, accepted boundary values, attribute)
BOUNDS = [
    ("AGENT_TURNS_PARTITIONS", ["1", "10000"], "partitions"),
    ("AGENT_DISPATCH_MAX_DEPTH", ["1", "1000000000"], "max_depth"),
    ("AGENT_DISPATCH_CLAIM_TTL_S", ["1", "300"], "claim_ttl_s"),
    ("AGENT_DISPATCH_VISIBILITY_TIMEOUT_S", ["1", "300"], "visibility_timeout_s"),
    ("AGENT_DISPATCH_SWEEP_INTERVAL_S", ["0.1", "300"], "sweep_interval_s"),
    ("AGENT_DISPATCH_MAX_ATTEMPTS", ["1", "100"], "max_attempts"),
    ("AGENT_DISPATCH_MAX_PAYLOAD_BYTES", ["1", str(64 * 1024 * 1024)], "max_payload_bytes"),
    ("AGENT_DISPATCH_METRICS_PORT", ["0", "65535"], "metrics_port"),
    ("AGENT_DISPATCH_RENEW_INTERVAL_S", ["0.1", "119.9"], "renew_interval_s"),
    ("AGENT_DISPATCH_CONCURRENCY", ["1", "256"], "concurrency"),
    ("AGENT_DISPATCH_CLAIM_BATCH", ["1", "256"], "claim_batch"),
    ("AGENT_DISPATCH_EXECUTOR_TIMEOUT_S", ["0.1", "3600"], "executor_timeout_s"),
    ("AGENT_DISPATCH_SHUTDOWN_GRACE_S", ["0", "3600"], "shutdown_grace_s"),
    ("AGENT_DISPATCH_GATEWAY_PORT", ["0", "65535"], "gateway_port"),
]


@pytest.mark.parametrize(("var", "values", "attr"), BOUNDS)
def test_bounds_accepted(monkeypatch: pytest.MonkeyPatch, var: str, values: list[str], attr: str) -> None:
    for value in values:
        cfg = load_with(monkeypatch, **{var: value})
        assert getattr(cfg, attr) == pytest.approx(float(value))


# (environment, variable the line must name, words the line must contain)
INVALID = [
    ({"TASK_QUEUE_BACKEND": "redis"}, "TASK_QUEUE_BACKEND", ["kafka, postgres, sqlite"]),
    ({"AGENT_TURNS_PARTITIONS": "0"}, "AGENT_TURNS_PARTITIONS", ["greater than or equal to 1", "1 to 10000"]),
    ({"AGENT_TURNS_PARTITIONS": "10001"}, "AGENT_TURNS_PARTITIONS", ["less than or equal to 10000"]),
    ({"AGENT_TURNS_PARTITIONS": "six"}, "AGENT_TURNS_PARTITIONS", ["valid integer"]),
    ({"AGENT_DISPATCH_MAX_DEPTH": "0"}, "AGENT_DISPATCH_MAX_DEPTH", ["greater than or equal to 1"]),
    ({"AGENT_DISPATCH_MAX_DEPTH": "-5"}, "AGENT_DISPATCH_MAX_DEPTH", ["greater than or equal to 1"]),
    (
        {"AGENT_DISPATCH_CLAIM_TTL_S": "301"},
        "AGENT_DISPATCH_CLAIM_TTL_S",
        ["less than or equal to 300", "RTO"],
    ),
    ({"AGENT_DISPATCH_CLAIM_TTL_S": "0"}, "AGENT_DISPATCH_CLAIM_TTL_S", ["greater than or equal to 1"]),
    ({"AGENT_DISPATCH_CLAIM_TTL_S": "soon"}, "AGENT_DISPATCH_CLAIM_TTL_S", ["valid number"]),
    (
        {"AGENT_DISPATCH_CLAIM_TTL_S": "60", "AGENT_DISPATCH_RENEW_INTERVAL_S": "60"},
        "AGENT_DISPATCH_RENEW_INTERVAL_S",
        ["below AGENT_DISPATCH_CLAIM_TTL_S (60 s)"],
    ),
    (
        {"AGENT_DISPATCH_RENEW_INTERVAL_S": "0"},
        "AGENT_DISPATCH_RENEW_INTERVAL_S",
        ["greater than or equal to 0.1"],
    ),
    ({"AGENT_DISPATCH_VISIBILITY_TIMEOUT_S": "600"}, "AGENT_DISPATCH_VISIBILITY_TIMEOUT_S", ["300"]),
    ({"AGENT_DISPATCH_SWEEP_INTERVAL_S": "0"}, "AGENT_DISPATCH_SWEEP_INTERVAL_S", ["greater than or equal"]),
    ({"AGENT_DISPATCH_MAX_ATTEMPTS": "0"}, "AGENT_DISPATCH_MAX_ATTEMPTS", ["1 to 100"]),
    ({"AGENT_DISPATCH_MAX_PAYLOAD_BYTES": "0"}, "AGENT_DISPATCH_MAX_PAYLOAD_BYTES", ["64 MiB"]),
    ({"STATE_DB_URI": "mysql://user:pw@db/agents"}, "STATE_DB_URI", ["postgresql://"]),
    ({"TASK_QUEUE_BACKEND": "postgres"}, "STATE_DB_URI", ["required when TASK_QUEUE_BACKEND=postgres"]),
    ({"TASK_QUEUE_BACKEND": "kafka"}, "KAFKA_BOOTSTRAP_SERVERS", ["required when TASK_QUEUE_BACKEND=kafka"]),
    ({"KAFKA_BOOTSTRAP_SERVERS": "broker"}, "KAFKA_BOOTSTRAP_SERVERS", ["not host:port"]),
    ({"KAFKA_BOOTSTRAP_SERVERS": "broker:99999"}, "KAFKA_BOOTSTRAP_SERVERS", ["not host:port"]),
    ({"AGENT_DISPATCH_SIGNING_KEY": "short"}, "AGENT_DISPATCH_SIGNING_KEY", ["too short", "32 characters"]),
    ({"AGENT_DISPATCH_LOG_LEVEL": "LOUD"}, "AGENT_DISPATCH_LOG_LEVEL", ["DEBUG, INFO, WARNING, ERROR"]),
    ({"AGENT_DISPATCH_LOG_FORMAT": "xml"}, "AGENT_DISPATCH_LOG_FORMAT", ["json, text"]),
    ({"AGENT_DISPATCH_KAFKA_TOPIC": "bad topic!"}, "AGENT_DISPATCH_KAFKA_TOPIC", ["Kafka topic name"]),
    ({"AGENT_DISPATCH_KAFKA_GROUP": "x" * 256}, "AGENT_DISPATCH_KAFKA_GROUP", ["at most 255"]),
    ({"AGENT_DISPATCH_METRICS_PORT": "70000"}, "AGENT_DISPATCH_METRICS_PORT", ["65535"]),
    ({"AGENT_DISPATCH_CONCURRENCY": "0"}, "AGENT_DISPATCH_CONCURRENCY", ["1 to 256"]),
    ({"AGENT_DISPATCH_CONCURRENCY": "257"}, "AGENT_DISPATCH_CONCURRENCY", ["less than or equal to 256"]),
    ({"AGENT_DISPATCH_CLAIM_BATCH": "0"}, "AGENT_DISPATCH_CLAIM_BATCH", ["1 to 256"]),
    ({"AGENT_DISPATCH_EXECUTOR": "rm -rf"}, "AGENT_DISPATCH_EXECUTOR", ["module:function"]),
    (
        {"AGENT_DISPATCH_EXECUTOR": "http"},
        "AGENT_DISPATCH_EXECUTOR_URL",
        ["required when AGENT_DISPATCH_EXECUTOR=http"],
    ),
    ({"AGENT_DISPATCH_EXECUTOR_URL": "ftp://x"}, "AGENT_DISPATCH_EXECUTOR_URL", ["http:// or https://"]),
    ({"AGENT_DISPATCH_EXECUTOR_TIMEOUT_S": "0"}, "AGENT_DISPATCH_EXECUTOR_TIMEOUT_S", ["0.1 to 3600"]),
    ({"AGENT_DISPATCH_SHUTDOWN_GRACE_S": "-1"}, "AGENT_DISPATCH_SHUTDOWN_GRACE_S", ["0 to 3600"]),
    ({"AGENT_DISPATCH_INSTANCE": "Bad_Name"}, "AGENT_DISPATCH_INSTANCE", ["DNS-1123"]),
    ({"AGENT_DISPATCH_NAMESPACE": "-x"}, "AGENT_DISPATCH_NAMESPACE", ["DNS-1123"]),
    ({"AGENT_DISPATCH_WORKER_ID": "a b"}, "AGENT_DISPATCH_WORKER_ID", ["up to 200"]),
    ({"AGENT_DISPATCH_GATEWAY_PORT": "65536"}, "AGENT_DISPATCH_GATEWAY_PORT", ["0 to 65535"]),
    ({"AGENT_DISPATCH_GATEWAY_PORT": "http"}, "AGENT_DISPATCH_GATEWAY_PORT", ["valid integer"]),
    ({"AGENT_DISPATCH_GATEWAY_HOST": "bad host"}, "AGENT_DISPATCH_GATEWAY_HOST", ["IP address or host name"]),
    ({"AGENT_DISPATCH_GATEWAY_URL": "ftp://x"}, "AGENT_DISPATCH_GATEWAY_URL", ["http:// or https://"]),
    ({"AGENT_DISPATCH_TOKEN": "short"}, "AGENT_DISPATCH_TOKEN", ["16 to 4096 printable"]),
]


INVALID_IDS = [f"{var}-{n}" for n, (_, var, _) in enumerate(INVALID)]


@pytest.mark.parametrize(("env", "var", "words"), INVALID, ids=INVALID_IDS)
def test_invalid_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], var: str, words: list[str]
) -> None:
    with pytest.raises(s.InvalidSetting) as info:
        load_with(monkeypatch, **env)
    assert len(info.value.lines) == 1
    line = info.value.lines[0]
    assert line.startswith(f"invalid setting {var}")
    for word in words:
        assert word in line


def test_gateway_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = s.load()
    assert (cfg.gateway_host, cfg.gateway_port, cfg.tokens_file) == ("127.0.0.1", 8080, None)
    assert cfg.gateway_url is None and cfg.token is None
    tokens = tmp_path / "tokens.yaml"
    cfg = load_with(
        monkeypatch,
        AGENT_DISPATCH_GATEWAY_HOST="0.0.0.0",
        AGENT_DISPATCH_GATEWAY_PORT="9000",
        AGENT_DISPATCH_TOKENS_FILE=str(tokens),
        AGENT_DISPATCH_GATEWAY_URL="http://gateway.agents:8080",
        AGENT_DISPATCH_TOKEN="t" * 32,
    )
    assert (cfg.gateway_host, cfg.gateway_port, cfg.tokens_file) == ("0.0.0.0", 9000, tokens)
    assert cfg.gateway_url == "http://gateway.agents:8080"
    assert cfg.token is not None and cfg.token.get_secret_value() == "t" * 32


def test_token_is_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(s.InvalidSetting) as info:
        load_with(monkeypatch, AGENT_DISPATCH_TOKEN="hunter4 with spaces")
    assert "hunter4" not in str(info.value)
    assert info.value.lines[0].startswith("invalid setting AGENT_DISPATCH_TOKEN:")


def test_secrets_are_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(s.InvalidSetting) as info:
        load_with(
            monkeypatch, STATE_DB_URI="mysql://alice:hunter2@db/agents", AGENT_DISPATCH_SIGNING_KEY="hunter3"
        )
    text = str(info.value)
    assert "hunter2" not in text and "hunter3" not in text and "alice" not in text
    assert len(info.value.lines) == 2


def run_entry(entry: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agent_dispatch.cli", *entry.split()[1:]]
    return subprocess.run(argv, env={**CLEAN, **env}, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("env", "var", "words"), INVALID, ids=INVALID_IDS)
def test_doctor_exits_2_with_one_line(env: dict[str, str], var: str, words: list[str]) -> None:
    proc = run_entry("agent-dispatch doctor", env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"agent-dispatch doctor: invalid setting {var}")


@pytest.mark.parametrize(
    "entry", ["agent-dispatch worker", "agent-dispatch migrate", "agent-dispatch gateway"]
)
@pytest.mark.parametrize("case", [INVALID[6], INVALID[9]], ids=["ttl-above-rto", "renew-not-below-ttl"])
def test_every_entry_point_exits_2(entry: str, case: tuple[dict[str, str], str, list[str]]) -> None:
    env, var, _ = case
    proc = run_entry(entry, env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert var in lines[0] and "invalid setting" in lines[0]
