"""``paramserve ps`` / ``paramserve worker`` listen where TF_CONFIG's task says (issue 11, item 8),
and the command line documents every flag (item 12)."""

from __future__ import annotations

import argparse
import json

import pytest
from certificates import make_certificates, needs_openssl

from paramserve.coordinator.commands import cli
from paramserve.psserver import __main__ as ps_main
from paramserve.psserver.runtime.command_line import resolve_address
from paramserve.worker import __main__ as worker_main

CLUSTER = {"ps": ["127.0.0.1:7001", "127.0.0.1:7002"], "worker": ["127.0.0.1:7101"], "chief": ["127.0.0.1:7201"]}


def tf_config(task_type: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": CLUSTER, "task": {"type": task_type, "index": index}})}


def address(module, argv, environ, role):
    parser = module.build_parser()
    return resolve_address(parser.parse_args(argv), parser, role, environ)


def test_the_ps_task_of_tf_config_gives_host_and_port():
    assert address(ps_main, [], tf_config("ps", 1), "ps") == ("127.0.0.1", 7002)
    assert address(worker_main, [], tf_config("worker", 0), "worker") == ("127.0.0.1", 7101)


def test_flags_win_over_tf_config_and_nothing_means_loopback_and_a_free_port():
    assert address(ps_main, ["--port", "9000"], tf_config("ps", 1), "ps") == ("127.0.0.1", 9000)
    assert address(ps_main, ["--host", "0.0.0.0", "--port", "9000"], tf_config("chief", 0), "ps") == ("0.0.0.0", 9000)
    assert address(ps_main, [], {}, "ps") == ("127.0.0.1", 0)


def test_a_task_of_another_role_is_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        address(ps_main, [], tf_config("worker", 0), "ps")
    error = capsys.readouterr().err
    assert "TF_CONFIG task is worker 0" in error and 'set task.type to "ps"' in error


def subcommand_help(name: str) -> str:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name].format_help()


@pytest.mark.parametrize("command", ["ps", "worker"])
def test_log_level_help_lists_its_choices_and_default(command):
    text = " ".join(subcommand_help(command).split())
    assert "how much to log: DEBUG, INFO, WARNING, ERROR (default: INFO)" in text


def test_every_demo_flag_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    undocumented = [a.dest for a in subparsers.choices["demo"]._actions if not a.help]
    assert undocumented == []
    assert "seed of the train/test split" in " ".join(subcommand_help("demo").split())


@needs_openssl
def test_replica_tls_presents_the_servers_own_certificate_and_needs_tls(tmp_path, capsys):
    certs = make_certificates(tmp_path / "certs")
    parser = ps_main.build_parser()
    argv = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--replica-tls-ca", str(certs.ca)]
    config = ps_main.config_from_args(parser.parse_args(argv), parser)
    assert config.replica_tls is not None
    assert (config.replica_tls.root_certificates, config.replica_tls.cert_chain) == (certs.ca, certs.cert)
    with pytest.raises(SystemExit):
        ps_main.config_from_args(parser.parse_args(["--replica-tls-ca", str(certs.ca)]), parser)
    assert "--replica-tls-ca needs --tls-cert" in capsys.readouterr().err
