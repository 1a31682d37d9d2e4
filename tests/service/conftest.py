"""Service tests run every client call both ways the client can travel: one unary Step
message per server (payloads under ClientConfig.max_unary_bytes), and chunked streams."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

TRANSPORTS = {"unary": None, "streams": 0}  # max_unary_bytes: the client's default, or never unary


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def make_client(make_client: Callable[..., Any], transport: str) -> Callable[..., Any]:
    def make(addresses: list[str], **overrides: object) -> Any:
        if TRANSPORTS[transport] is not None:
            overrides.setdefault("max_unary_bytes", TRANSPORTS[transport])
        return make_client(addresses, **overrides)

    return make
