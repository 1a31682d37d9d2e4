"""ParameterServerStrategy reads what ``paramserve launch`` sets: the cluster and the token
(issue 11, item 6: the README's first snippet passes no token)."""

from __future__ import annotations

from paramserve.coordinator.strategies import ParameterServerStrategy

ENVIRON = {"PARAMSERVE_PS": "127.0.0.1:9", "PARAMSERVE_WORKERS": "127.0.0.1:10", "PARAMSERVE_TOKEN": "s3cret"}


def test_the_token_comes_from_paramserve_token_when_none_is_passed():
    strategy = ParameterServerStrategy(environ=ENVIRON)  # nothing is dialled
    try:
        assert strategy.token == "s3cret"
        assert strategy.client.config.token == "s3cret", "the parameter-server client presents it too"
        assert strategy.cluster.parameter_servers == ("127.0.0.1:9",)
    finally:
        strategy.close()


def test_a_token_passed_wins_and_none_set_means_none():
    explicit = ParameterServerStrategy(token="mine", environ=ENVIRON)
    unset = ParameterServerStrategy(environ={k: v for k, v in ENVIRON.items() if k != "PARAMSERVE_TOKEN"})
    try:
        assert explicit.token == "mine"
        assert unset.token is None
    finally:
        explicit.close()
        unset.close()
