"""The metrics API's HTTP server over real TLS with real certificates, without a cluster: discovery
answers any TLS client; a metric request is 401 unless the client certificate verifies against the
requestheader CA *and* names an allowed front proxy (the SubjectAccessReview that follows needs an
API server and is exercised on the real node, tests/node/test_autoscaling.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent_dispatch.metrics_api import _api, _auth, _server
from testenv._common import free_port

METRIC = "/apis/external.metrics.k8s.io/v1beta1/namespaces/ns/agent_dispatch_queue_depth"


def _cert(cn: str, issuer: tuple[Any, x509.Certificate] | None, *, ca: bool = False, san: str | None = None):  # type: ignore[no-untyped-def]
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[1].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    cert = builder.sign(issuer[0] if issuer else key, hashes.SHA256())
    return key, cert


def _write(path: Path, key: Any, cert: x509.Certificate) -> tuple[str, str]:
    crt, pem = path.with_suffix(".crt"), path.with_suffix(".key")
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(crt), str(pem)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tls")
    serving_ca = _cert("serving-ca", None, ca=True)
    serving = _write(tmp / "serving", *_cert("localhost", serving_ca, san="localhost"))
    proxy_ca = _cert("front-proxy-ca", None, ca=True)
    files = {
        "serving_ca": _write(tmp / "serving-ca", *serving_ca)[0],
        "proxy": _write(tmp / "proxy", *_cert("front-proxy-client", proxy_ca)),
        "intruder": _write(tmp / "intruder", *_cert("someone", proxy_ca)),
        "stranger": _write(tmp / "stranger", *_cert("front-proxy-client", _cert("other-ca", None, ca=True))),
    }
    proxy_ca_pem = proxy_ca[1].public_bytes(serialization.Encoding.PEM).decode()
    config = _auth.RequestHeaderConfig(client_ca=proxy_ca_pem, allowed_names=("front-proxy-client",))
    now = _api.rfc3339(dt.datetime.now(dt.UTC))
    items = [
        {"metadata": {"name": "a", "namespace": "ns"}, "status": {"queueDepth": 4, "queueDepthTime": now}}
    ]
    backend = _server.Backend(
        api_client=None,
        list_dispatches=lambda _ns: items,
        namespaces=frozenset({"ns"}),
        auth_config=lambda: config,
    )
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def serve() -> None:
        runner = web.AppRunner(_server.build_app(backend))
        await runner.setup()
        context = _auth.server_context(*serving, proxy_ca_pem)
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
        started.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True
    )
    thread.start()
    assert started.wait(10)
    try:
        yield {"port": port, **files}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _get(
    server: dict[str, Any], path: str, cert: tuple[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    context = ssl.create_default_context(cafile=server["serving_ca"])
    if cert:
        context.load_cert_chain(*cert)
    request = urllib.request.Request(
        f"https://localhost:{server['port']}{path}",
        headers={"X-Remote-User": "system:admin", "X-Remote-Group": "system:masters"},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def test_discovery_is_served_over_tls_to_any_client(server: dict[str, Any]) -> None:
    status, body = _get(server, "/apis/external.metrics.k8s.io/v1beta1")
    assert status == 200 and body == _api.api_resource_list()
    assert _get(server, "/apis")[1]["groups"][0]["name"] == "external.metrics.k8s.io"
    assert _get(server, "/openapi/v2")[0] == 200


def test_forged_headers_without_the_front_proxy_certificate_get_401(server: dict[str, Any]) -> None:
    status, body = _get(server, METRIC)
    assert status == 401 and body["kind"] == "Status" and body["reason"] == "Unauthorized"


def test_a_certificate_of_the_ca_with_a_name_not_allowed_gets_401(server: dict[str, Any]) -> None:
    status, body = _get(server, METRIC, server["intruder"])
    assert status == 401 and "not an allowed front-proxy name" in body["message"]


def test_a_certificate_of_another_ca_fails_the_handshake(server: dict[str, Any]) -> None:
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _get(server, METRIC, server["stranger"])
