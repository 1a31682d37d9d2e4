"""Optional TLS on the parameter server: a client that trusts the certificate works, a plaintext one does not."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from paramserve.psserver.protocol.errors import ServerUnavailableError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.runtime.security import TlsConfig

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make a certificate"
)


@pytest.fixture
def certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_client_round_trips_and_plaintext_client_is_refused(start_ps, make_client, certificate):
    cert, key = certificate
    server = start_ps(tls=TlsConfig(cert, key))
    secure = make_client([server.address], tls_root_certificates=cert)
    secure.create_variable("w", torch.arange(6.0), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    secure.push({"w": torch.ones(6)})
    assert torch.equal(secure.pull(["w"]).tensors["w"], torch.arange(6.0) - 1)

    plaintext = make_client([server.address], retry_deadline=1.0, call_timeout=1.0)
    plaintext.adopt_layouts(secure.layouts)
    with pytest.raises(ServerUnavailableError) as caught:
        plaintext.pull(["w"])
    assert caught.value.server == server.address
