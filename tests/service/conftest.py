"""Service tests run every client call each way the client can travel: a step frame per server
on the servers' data planes (the default, for payloads under ClientConfig.max_unary_bytes), one
unary Step RPC per server (the data plane turned off), and chunked streams."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

TRANSPORTS: dict[str, dict[str, object]] = {
    "dataplane": {},
    "unary": {"data_plane": False},
    "streams": {"max_unary_bytes": 0, "data_plane": False},  # never one message: Push and Pull streams
}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def make_client(make_client: Callable[..., Any], transport: str) -> Callable[..., Any]:
    def make(addresses: list[str], **overrides: object) -> Any:
        return make_client(addresses, **{**TRANSPORTS[transport], **overrides})

    return make
