"""What the parameter-server RPCs carry besides their messages, agreed by servers and clients.

The .proto declares the messages; this is the rest both sides must spell alike: the service's
name (every method's path starts with it), the metadata key a Push stream's idempotency key
travels in, and how text (an error's variable name) is escaped into a metadata value and read
back. A module of its own so that a client needs none of the server's modules to speak it.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

__all__ = [
    "IDEMPOTENCY_METADATA_KEY",
    "MAX_ERROR_METADATA_CHARS",
    "REPLICA_EPOCH_METADATA_KEY",
    "SERVICE_NAME",
    "metadata_text",
    "metadata_value",
]

SERVICE_NAME = "paramserve.wire.v1.ParameterServer"
IDEMPOTENCY_METADATA_KEY = "paramserve-idempotency-key"
REPLICA_EPOCH_METADATA_KEY = "paramserve-replica-epoch"
"""On a write a primary forwards to its backup: the primary's epoch (psserver/replication/replica.py)."""

MAX_ERROR_METADATA_CHARS = 3072
"""Longest escaped value of the ``paramserve-error-variable`` trailer (a name of the longest
allowed size, 1 KiB, fits escaped), and of an error's details as gRPC percent-encodes them:
together they stay under the 8 KiB of metadata a gRPC client accepts by default."""
# Printable ASCII but the space and '%' (the escape character): what a metadata value may hold.
_METADATA_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
_ELLIPSIS = "%E2%80%A6"


def metadata_value(text: str, limit: int = MAX_ERROR_METADATA_CHARS) -> str:
    """``text`` percent-escaped to what a metadata value may hold (gRPC fails the whole call with
    INTERNAL for anything else), cut to ``limit`` characters (ending in an escaped "...")."""
    escaped = quote(text.encode("utf-8", "backslashreplace"), safe=_METADATA_SAFE)
    if len(escaped) <= limit:
        return escaped
    cut = escaped[: limit - len(_ELLIPSIS)]
    tail = cut.rfind("%", len(cut) - 2)
    return (cut[:tail] if tail >= 0 else cut) + _ELLIPSIS


def metadata_text(value: str) -> str:
    """The text ``metadata_value`` escaped."""
    return unquote(value)
