"""The health probe: is the server at ``host:port`` SERVING? (``paramserve-health``)

Container health checks run it every few seconds in every container, so it costs what a
bare Python start costs: it speaks ``grpc.health.v1.Health/Check`` over one plaintext
HTTP/2 connection with the standard library alone. Importing grpcio costs about 120 ms
of CPU by itself (its Cython core imports asyncio), torch 1.5 s; this needs neither, nor
any other paramserve module (this package's ``__init__`` imports nothing eagerly).
``benchmarks/health_probe.py`` measures it against ``paramserve health`` (figures in
deploy/README.md). Kubernetes needs no probe process: its kubelet speaks grpc.health.v1.

The client is the smallest gRPC unary call: the HTTP/2 preface, empty SETTINGS, one
HEADERS frame of literal fields, one DATA frame with the request; it reads frames until
the stream ends, answering the server's SETTINGS. The reply's trailers are read with a
minimal HPACK decoder (indexed and literal fields, no Huffman: grpc core sends gRPC's
own headers as plain literals); a trailer it cannot decode falls back on the message.

Exit status: 0 when the server reports SERVING, 1 otherwise (NOT_SERVING, unknown
service, unreachable, a failed call), 2 for a bad command line. Plaintext only: a
server with ``--tls-cert`` is probed by Kubernetes' gRPC probes or by grpc clients.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time

__all__ = ["UNREACHABLE", "add_arguments", "check", "main", "probe"]

UNREACHABLE = "UNREACHABLE"
METHOD = b"/grpc.health.v1.Health/Check"
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
"""grpc.health.v1.HealthCheckResponse.ServingStatus."""
STATUS_CODES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
"""gRPC status codes by number."""

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _CONTINUATION = 0, 1, 3, 4, 6, 7, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_STREAM = 1
_STATIC_TABLE_SIZE = 61  # RFC 7541 Appendix A; none of its names is a gRPC header


class ProbeError(Exception):
    """The server's answer could not be understood."""


# ---------------------------------------------------------------- the call


def check(address: str, timeout: float, service: str = "") -> str:
    """The server's health status name (SERVING, NOT_SERVING, ...), UNREACHABLE when no answer
    came within ``timeout`` seconds, or the gRPC status code name of a failed call (e.g.
    NOT_FOUND for a service the server does not know)."""
    host, port = _split(address)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_request(address, service))
            reply = _read_reply(sock, deadline)
    except (OSError, TimeoutError):
        return UNREACHABLE
    except ProbeError as err:
        return f"PROTOCOL_ERROR ({err})"
    return reply.verdict()


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _request(authority: str, service: str) -> bytes:
    headers = b"".join(
        _literal(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", METHOD),
            (b":authority", authority.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )
    name = service.encode()
    message = b"\x0a" + _varint(len(name)) + name if name else b""  # HealthCheckRequest.service = 1
    body = b"\x00" + struct.pack(">I", len(message)) + message  # not compressed, length, message
    return (
        _PREFACE
        + _frame(_SETTINGS, 0, 0)
        + _frame(_HEADERS, _END_HEADERS, _STREAM, headers)
        + _frame(_DATA, _END_STREAM, _STREAM, body)
    )


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal field without indexing, new name, strings not Huffman-coded."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(value: int, prefix: int, first: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# ---------------------------------------------------------------- the answer


class _Reply:
    """What came back on the call's stream (no dataclass: its import costs ~20 ms of CPU)."""

    def __init__(self) -> None:
        self.message = b""
        self.headers: dict[bytes, bytes] = {}
        self.reset: int | None = None

    def verdict(self) -> str:
        if self.reset is not None:
            return f"RESET ({self.reset})"
        status = self.headers.get(b"grpc-status")
        if status is None and self.message == b"":
            raise ProbeError("the stream ended with neither a status nor a message")
        code = int(status) if status is not None and status.isdigit() else 0
        if code != 0:
            name = STATUS_CODES[code] if code < len(STATUS_CODES) else str(code)
            return UNREACHABLE if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else name
        return SERVING_STATUS.get(_serving_status(self.message), "UNKNOWN")


def _read_reply(sock: socket.socket, deadline: float) -> _Reply:
    reply, decoder = _Reply(), _HpackDecoder()
    block, buffer, ended = b"", b"", False
    while True:
        while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer in time")
            sock.settimeout(remaining)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            buffer += data
        size = int.from_bytes(buffer[:3], "big")
        kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
        payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
        if kind == _SETTINGS and not flags & _ACK:
            sock.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            sock.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind == _GOAWAY:
            raise ConnectionError("the server sent GOAWAY")
        elif stream != _STREAM:
            continue
        elif kind == _RST_STREAM:
            reply.reset = int.from_bytes(payload[:4], "big")
            return reply
        elif kind == _DATA:
            reply.message += _unpad(payload, flags)
        elif kind in (_HEADERS, _CONTINUATION):
            block += _header_fragment(payload, flags) if kind == _HEADERS else payload
            if flags & _END_HEADERS:
                reply.headers.update(decoder.decode(block))
                block = b""
        ended = ended or (stream == _STREAM and kind in (_DATA, _HEADERS) and bool(flags & _END_STREAM))
        if ended and not block:  # a trailer block split over CONTINUATION frames ends with them
            return reply


def _unpad(payload: bytes, flags: int) -> bytes:
    if flags & _PADDED:
        return payload[1 : len(payload) - payload[0]]
    return payload


def _header_fragment(payload: bytes, flags: int) -> bytes:
    payload = _unpad(payload, flags)
    return payload[5:] if flags & _PRIORITY else payload


def _serving_status(message: bytes) -> int:
    """HealthCheckResponse.status (field 1, a varint) from a gRPC length-prefixed message."""
    if len(message) < 5 or message[0] != 0:
        raise ProbeError("the reply is not one uncompressed gRPC message")
    body, position, status = message[5 : 5 + int.from_bytes(message[1:5], "big")], 0, 0
    while position < len(body):
        key, position = _read_varint(body, position)
        if key & 7 != 0:
            raise ProbeError("HealthCheckResponse holds a field it should not")
        value, position = _read_varint(body, position)
        if key >> 3 == 1:
            status = value
    return status


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data):
            raise ProbeError("a truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


class _HpackDecoder:
    """Just enough HPACK (RFC 7541) for one response's headers: the fields' names and values
    where they are literal strings; a Huffman-coded string decodes as None (and is skipped)."""

    def __init__(self) -> None:
        self._dynamic: list[tuple[bytes | None, bytes | None]] = []  # newest first

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        headers: dict[bytes, bytes] = {}
        position = 0
        while position < len(block):
            byte = block[position]
            if byte & 0x80:  # indexed field
                index, position = self._int(block, position, 7)
                name, value = self._entry(index)
            elif byte & 0xC0 == 0x40:  # literal, added to the table
                name, value, position = self._field(block, position, 6)
                self._dynamic.insert(0, (name, value))
            elif byte & 0xE0 == 0x20:  # table size update
                _size, position = self._int(block, position, 5)
                continue
            else:  # literal, not indexed or never indexed
                name, value, position = self._field(block, position, 4)
            if name is not None and value is not None:
                headers[name] = value
        return headers

    def _field(self, block: bytes, position: int, prefix: int) -> tuple[bytes | None, bytes | None, int]:
        index, position = self._int(block, position, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, position = self._string(block, position)
        value, position = self._string(block, position)
        return name, value, position

    def _entry(self, index: int) -> tuple[bytes | None, bytes | None]:
        if index <= _STATIC_TABLE_SIZE:
            return None, None  # a static entry: never a gRPC header
        if index - _STATIC_TABLE_SIZE > len(self._dynamic):
            raise ProbeError(f"HPACK index {index} is not in the table")
        return self._dynamic[index - _STATIC_TABLE_SIZE - 1]

    def _string(self, block: bytes, position: int) -> tuple[bytes | None, int]:
        huffman = block[position] & 0x80
        length, position = self._int(block, position, 7)
        text = block[position : position + length]
        if len(text) < length:
            raise ProbeError("a truncated header block")
        return (None if huffman else text), position + length

    @staticmethod
    def _int(block: bytes, position: int, prefix: int) -> tuple[int, int]:
        limit = (1 << prefix) - 1
        value = block[position] & limit
        position += 1
        if value < limit:
            return value, position
        shift = 0
        while True:
            if position >= len(block):
                raise ProbeError("a truncated header block")
            byte = block[position]
            position += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, position


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("address", help="host:port of a parameter server or worker")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: %(default)s)"
    )
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--quiet", action="store_true", help="print nothing; the exit status says it")
    return parser


def probe(args: argparse.Namespace) -> int:
    """Checks once, prints ``address: STATUS`` unless quiet; the exit status."""
    status = check(args.address, args.timeout, args.service)
    if not args.quiet:
        print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="paramserve-health", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )
    args = parser.parse_args(argv)
    try:
        return probe(args)
    except ValueError as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
