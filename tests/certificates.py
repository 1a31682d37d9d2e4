"""Test certificates, made in the test with the openssl command: a CA, and a certificate it
signs for 127.0.0.1/localhost that serves as both a server and a client certificate."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass(frozen=True)
class Certificates:
    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path
    other_cert: pathlib.Path
    """Signed by another CA: a client the servers must refuse."""
    other_key: pathlib.Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(directory: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    _openssl(
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
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return cert, key


def _leaf(
    directory: pathlib.Path, name: str, ca: tuple[pathlib.Path, pathlib.Path]
) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key, csr = directory / f"{name}.pem", directory / f"{name}-key.pem", directory / f"{name}.csr"
    extensions = directory / f"{name}.ext"
    extensions.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca[0]),
        "-CAkey",
        str(ca[1]),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "1",
        "-extfile",
        str(extensions),
    )
    return cert, key


def make_certificates(directory: pathlib.Path) -> Certificates:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    cert, key = _leaf(directory, "node", ca)
    other_cert, other_key = _leaf(directory, "stranger", _ca(directory, "other-ca"))
    return Certificates(ca[0], cert, key, other_cert, other_key)
