import logging

from paramserve.psserver.runtime.rate_limited_log import RateLimitedLog


def test_one_line_per_key_per_period_then_the_count_left_out(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.rate"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.rate"):
        assert limited.warning("flood", "refused %s", "a")
        assert not limited.warning("flood", "refused %s", "b")
        assert not limited.warning("flood", "refused %s", "c")
        assert limited.log("other", logging.INFO, "another kind")
        now[0] = 10.0
        assert limited.warning("flood", "refused %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "another kind",
        "refused d (and 2 more like it)",
    ]
