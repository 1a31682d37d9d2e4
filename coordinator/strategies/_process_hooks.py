"""Process-wide hooks and patches, each with one owner that installs and removes it.

Some things a strategy needs can only be done process-wide: torch's global module
and optimizer hooks, ``torch.optim.Optimizer.__init__`` while a scope is open.
Each such hook is a :class:`SharedHook`: installed when its first holder acquires
it, removed when its last holder releases it, so a process whose strategies are
all closed is left exactly as torch made it (a test checks this).

A holder that may be garbage-collected without releasing (a strategy dropped
without ``close()``) holds a :class:`Lease`: its ``drop()`` is safe to call from a
garbage-collection callback. It only marks the lease; the hook is removed at the
next ``acquire``/``release`` of any holder, never from inside the collector, which
may run in any thread at any allocation (even one iterating torch's hook dicts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Lease", "SharedHook"]

Uninstall = Callable[[], None]


class Lease:
    """One holder's claim on a SharedHook. ``release()`` once (idempotent); ``drop()`` from a
    garbage-collection callback."""

    def __init__(self, hook: SharedHook):
        self._hook = hook
        self.released = False
        self.dropped = False

    def release(self) -> None:
        self._hook._release(self)

    def drop(self) -> None:
        self.dropped = True


class SharedHook:
    """A hook installed while at least one lease on it is live.

    ``install()`` puts the hook in place and returns the function that removes it.
    """

    def __init__(self, name: str, install: Callable[[], Uninstall]):
        self.name = name
        self._install = install
        self._lock = threading.Lock()
        self._leases: list[Lease] = []
        self._uninstall: Uninstall | None = None

    @property
    def installed(self) -> bool:
        with self._lock:
            return self._uninstall is not None

    def acquire(self) -> Lease:
        """A new lease; installs the hook if it was not."""
        lease = Lease(self)
        with self._lock:
            self._forget_dropped()
            self._leases.append(lease)
            if self._uninstall is None:
                self._uninstall = self._install()
        return lease

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                self._leases = [held for held in self._leases if held is not lease]
            self._forget_dropped()
            if not self._leases and self._uninstall is not None:
                uninstall, self._uninstall = self._uninstall, None
                uninstall()

    def _forget_dropped(self) -> None:  # under the lock
        for held in self._leases:
            if held.dropped:
                held.released = True
        self._leases = [held for held in self._leases if not held.released]
        if not self._leases and self._uninstall is not None:
            uninstall, self._uninstall = self._uninstall, None
            uninstall()
