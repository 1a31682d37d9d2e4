"""The status page transport's pure decisions: which connection to take, drop or leave in the
backlog (``admit``), the descriptors kept for the coordinator (and how they are counted), how long
the kernel keeps a silent connection back (``defer_accept_seconds``) and the deadline it then has
(``request_deadline``), and where a request ends."""

from __future__ import annotations

import os
import pathlib

import pytest

from paramserve.coordinator.status.page_server import (
    MIN_RESERVE,
    Admission,
    Descriptors,
    PageLimits,
    RequestTooLarge,
    admit,
    count_descriptors,
    defer_accept_seconds,
    descriptor_reserve,
    refill,
    request_deadline,
    request_end,
)

LIMITS = PageLimits(max_connections=4)
PLENTY = Descriptors(open=10, soft_limit=1024)


@pytest.mark.parametrize(("soft", "reserve"), [(1024, 256), (256, MIN_RESERVE), (100, MIN_RESERVE), (65536, 16384)])
def test_the_reserve_is_a_quarter_of_the_soft_limit_and_never_below_the_minimum(soft, reserve):
    assert descriptor_reserve(soft) == reserve


def test_a_free_slot_is_taken():
    assert admit(3, 3, PLENTY, 1, LIMITS) is Admission.ACCEPT
    assert admit(0, 0, None, 1, LIMITS) is Admission.ACCEPT, "descriptors not known: the cap alone"


def test_when_full_the_oldest_connection_still_sending_its_request_makes_room():
    assert admit(4, 1, PLENTY, 1, LIMITS) is Admission.EVICT_OLDEST


def test_when_every_connection_is_being_answered_the_newcomer_waits_in_the_backlog():
    assert admit(4, 0, PLENTY, 1, LIMITS) is Admission.WAIT_FOR_SLOT


def test_the_coordinator_s_reserve_of_descriptors_comes_before_any_reader():
    line = 1024 - descriptor_reserve(1024)
    assert admit(0, 0, Descriptors(line - 1, 1024), 1, LIMITS) is Admission.ACCEPT
    assert admit(0, 0, Descriptors(line, 1024), 1, LIMITS) is Admission.WAIT_FOR_DESCRIPTORS
    assert admit(4, 4, Descriptors(1024, 1024), 1, LIMITS) is Admission.WAIT_FOR_DESCRIPTORS, "even to evict"


HEAD = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
POST = b"POST / HTTP/1.1\r\ncontent-length: 4\r\n\r\n"
NOT_HTTP = b"\x16\x03\x01 not http at all\r\n\r\n"


def test_accepts_are_bounded_per_second_after_a_burst():
    limits = PageLimits(accepts_per_second=100.0, accept_burst=8)
    assert admit(0, 0, PLENTY, 0.5, limits) is Admission.WAIT_FOR_RATE
    assert admit(0, 0, PLENTY, 1.0, limits) is Admission.ACCEPT
    assert refill(0.0, 0.005, limits) == pytest.approx(0.5)
    assert refill(0.5, 0.005, limits) == pytest.approx(1.0)
    assert refill(2.0, 60.0, limits) == 8.0, "never over the burst"
    assert refill(2.0, -1.0, limits) == 2.0, "a clock that went back adds nothing"
    assert admit(4, 1, Descriptors(1024, 1024), 0.0, limits) is Admission.WAIT_FOR_DESCRIPTORS


@pytest.mark.parametrize(
    ("received", "end"),
    [
        (b"", None),
        (HEAD[:-2], None),
        (HEAD, len(HEAD)),
        (HEAD.replace(b"\r\n", b"\n"), len(HEAD) - 3),
        (HEAD + b"GET /again", len(HEAD)),
        (POST + b"ab", None),
        (POST + b"abcd", len(POST) + 4),
        (POST.replace(b"4", b"many"), len(POST) + 3),
        (NOT_HTTP, len(NOT_HTTP)),
    ],
)
def test_a_request_ends_after_its_headers_and_declared_body(received, end):
    assert request_end(received, 1024) == end


@pytest.mark.parametrize(
    "received",
    [
        b"GET /" + b"a" * 2000,
        b"POST / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
    ],
)
def test_a_request_over_the_limit_is_refused_before_more_is_read(received):
    with pytest.raises(RequestTooLarge):
        request_end(received, 1024)


@pytest.mark.parametrize(
    ("request_seconds", "deferred"),
    [(10.0, 3), (2.0, 1), (14.0, 7), (30.0, 15), (1.9, 0), (0.5, 0), (1e6, 127)],
)
def test_silent_connections_wait_in_the_kernel_one_of_its_periods_within_half_the_deadline(request_seconds, deferred):
    """The kernel rounds TCP_DEFER_ACCEPT up to its SYN-ACK periods (1, 3, 7, ... s): the one
    chosen is a period, and the longest within half of the request deadline."""
    assert defer_accept_seconds(request_seconds) == deferred
    assert deferred == 0 or (deferred + 1) & deferred == 0, "a period: 2**n - 1"


def test_a_connection_the_kernel_kept_back_silent_has_its_deadline_from_its_connect():
    limits = PageLimits(request_seconds=10.0)
    assert request_deadline(100.0, False, 3, limits) == 110.0, "it spoke: from the accept"
    assert request_deadline(100.0, True, 3, limits) == 107.0, "silent 3 s in the kernel already"
    assert request_deadline(100.0, True, 0, limits) == 110.0, "not deferred: from the accept"
    assert request_deadline(100.0, True, 15, limits) == 100.0, "never before the accept"


@pytest.mark.skipif(not pathlib.Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_descriptors_are_counted_as_a_listing_counts_them(tmp_path):
    def listed() -> int:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own

    before = count_descriptors("/proc/self/fd")
    assert before == listed()
    opened = [os.open(tmp_path, os.O_RDONLY) for _ in range(10)]
    try:
        assert count_descriptors("/proc/self/fd") == before + 10 == listed()
        if pathlib.Path("/dev/fd").is_dir():
            assert count_descriptors("/dev/fd") == before + 10, "listed where the size is not known to count"
    finally:
        for descriptor in opened:
            os.close(descriptor)
