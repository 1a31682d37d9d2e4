"""The health probe's HTTP/2 and HPACK pieces, on bytes a grpc server sent."""

from __future__ import annotations

import pytest

from paramserve.psserver.runtime import health_probe as hp

# Trailers grpc core (1.85) sent for a Check of an unknown service: literal fields with incremental
# indexing and new names, not Huffman-coded.
NOT_FOUND_TRAILERS = bytes.fromhex("400b677270632d7374617475730135000c677270632d6d65737361676500")
RESPONSE_HEADERS = bytes.fromhex(
    "88400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634014677270632d6163636570742d656e636f"
    "64696e67176964656e746974792c206465666c6174652c20677a6970"
)


def test_hpack_reads_literal_and_indexed_fields() -> None:
    decoder = hp._HpackDecoder()
    assert decoder.decode(RESPONSE_HEADERS) == {
        b"content-type": b"application/grpc",
        b"grpc-accept-encoding": b"identity, deflate, gzip",
    }
    assert decoder.decode(NOT_FOUND_TRAILERS) == {b"grpc-status": b"5", b"grpc-message": b""}
    # grpc-message came without indexing: 0xbe indexes entry 62, the newest added (grpc-status),
    # 0xc0 entry 64, the first (content-type).
    assert decoder.decode(bytes([0xBE, 0xC0])) == {b"grpc-status": b"5", b"content-type": b"application/grpc"}


def test_hpack_skips_huffman_strings_and_refuses_unknown_indices() -> None:
    huffman_value = bytes([0x40, 0x0B]) + b"grpc-status" + bytes([0x81, 0x00])
    assert hp._HpackDecoder().decode(huffman_value) == {}
    with pytest.raises(hp.ProbeError):
        hp._HpackDecoder().decode(bytes([0xFF, 0x00]))  # index 127 + 0: no such entry


@pytest.mark.parametrize(
    "message, status",
    [(bytes.fromhex("00000000020801"), 1), (bytes.fromhex("00000000020802"), 2), (bytes.fromhex("0000000000"), 0)],
)
def test_serving_status_comes_from_field_1(message: bytes, status: int) -> None:
    assert hp._serving_status(message) == status


def test_a_reply_is_judged_by_its_status_then_its_message() -> None:
    reply = hp._Reply()
    reply.message, reply.headers = bytes.fromhex("00000000020801"), {b"grpc-status": b"0"}
    assert reply.verdict() == "SERVING"
    reply.headers = {b"grpc-status": b"16"}
    assert reply.verdict() == "UNAUTHENTICATED"
    reply.headers = {b"grpc-status": b"14"}
    assert reply.verdict() == hp.UNREACHABLE


def test_the_request_is_one_settings_headers_and_data() -> None:
    request = hp._request("ps0:5000", "svc")
    assert request.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert b"/grpc.health.v1.Health/Check" in request and request.endswith(b"\x00\x00\x00\x00\x05\x0a\x03svc")


@pytest.mark.parametrize("address, expected", [("ps0:5000", ("ps0", 5000)), ("[::1]:6000", ("::1", 6000))])
def test_addresses(address: str, expected: tuple[str, int]) -> None:
    assert hp._split(address) == expected
    with pytest.raises(ValueError):
        hp._split("ps0")


def test_the_psserver_package_names_its_exports_and_imports_them_when_first_used() -> None:
    import paramserve.psserver as psserver
    from paramserve.psserver.server import build_server

    assert sorted(psserver.__all__) == sorted(psserver._HOMES)
    assert psserver.build_server is build_server
    with pytest.raises(AttributeError):
        psserver.no_such_name  # noqa: B018
