"""What every multihost test needs: the network namespaces' requirements, or a clean skip."""

from __future__ import annotations

import pytest
from network_hosts import missing_requirements


@pytest.fixture(scope="module")
def requirements() -> None:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(f"tests/multihost {reason}")
