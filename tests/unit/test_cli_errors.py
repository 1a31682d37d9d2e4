"""Issue 10, CLI: a bad flag or configuration ends with one line naming the fix and exit
status 2, with no traceback (``--debug`` shows it); ports are range-checked; ``--version`` works.

Most cases run ``paramserve``'s entry point in this process (each stops before anything
starts); two run the real command, to see exactly what a user sees."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from paramserve.coordinator.commands import cli

CLI = [sys.executable, "-m", "paramserve.coordinator.commands.cli"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """A server that fails to start may have set torch's threads first: give them back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_in_process(args: list[str], capsys) -> tuple[int, str]:
    try:
        status = cli.main(args)
    except SystemExit as stop:  # argparse's own exit for a flag it cannot parse
        status = int(stop.code or 0)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["ps", "--token-file", "/nonexistent/token"], {}, "--token-file /nonexistent/token: cannot read it"),
        (["ps"], {"PARAMSERVE_TOKEN": ""}, "PARAMSERVE_TOKEN is empty"),
        (["worker"], {"PARAMSERVE_TOKEN": " "}, "PARAMSERVE_TOKEN is empty"),
        (["ps", "--max-workers", "0"], {}, "--max-workers: 0 is not allowed"),
        (["ps", "--port", "70000"], {}, "70000 is not a port"),
        (["ps", "--port", "-5"], {}, "-5 is not a port"),
        (["worker", "--metrics-port", "65536"], {}, "65536 is not a port"),
        (["ps", "--host", "0.0.0.0"], {}, "--insecure"),
        (["worker", "--host", "0.0.0.0"], {}, "--insecure"),
        (["ps"], {"TF_CONFIG": "{not json"}, "TF_CONFIG"),
        (["launch", "--ps", "0", "--", "true"], {}, "--ps"),
        (
            ["demo", "--cluster-from-env"],
            {"PARAMSERVE_PS": "not an address", "PARAMSERVE_WORKERS": "127.0.0.1:1"},
            "PARAMSERVE_PS",
        ),
        (["demo", "--checkpoint-dir", "/proc/paramserve-cannot-write"], {}, "--checkpoint-dir"),
        (["ps", "--checkpoint-root", "/proc/paramserve-cannot-write"], {}, "--checkpoint-root"),
        (["worker", "--ps-retry-deadline", "0"], {}, "--ps-retry-deadline"),
        (["demo", "--tls-ca", "ca.pem"], {}, "--tls-ca, --tls-cert and --tls-key together"),
        # Issue 20's findings: each names its own flag, none is a traceback.
        (["ps", "--max-staleness", "-1"], {}, "--max-staleness: -1 is not allowed"),
        (["ps", "--tls-cert", __file__, "--tls-key", __file__], {}, "are not a PEM certificate chain"),
        (["ps", "--port-file", "/proc/paramserve-cannot-write/port.json"], {}, "--port-file"),
        (["worker", "--ps-tls-cert", __file__, "--ps-tls-key", __file__], {}, "need --ps-tls-ca"),
        (["worker", "--ps-token-file", "/nonexistent/token"], {}, "--ps-token-file /nonexistent/token"),
        (["health", "not-an-address"], {}, "not-an-address"),
    ],
)
def test_bad_configurations_end_in_one_line_and_status_2(args, env, says, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, stderr = run_in_process(args, capsys)
    assert status == 2, stderr
    assert "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and says in lines[0], stderr


def test_a_busy_port_is_one_line_naming_the_flag_not_grpc():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run(
            [*CLI, "ps", "--port", str(taken.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == error_lines(result.stderr)
    assert "cannot listen on 127.0.0.1" in result.stderr and "--port" in result.stderr


def test_debug_shows_the_traceback(capsys):
    status, stderr = run_in_process(["--debug", "ps", "--token-file", "/nonexistent/token"], capsys)
    assert status == 2 and "Traceback" in stderr


def test_version():
    result = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("paramserve ")


@pytest.mark.parametrize(
    ("argv", "chosen"),
    [(["ps", "--port", "0"], "ps"), (["--debug", "worker"], "worker"), (["--help"], None), (["serve"], None)],
)
def test_the_command_a_process_names_is_the_only_one_it_imports(argv, chosen):
    assert cli.chosen_command(argv) == chosen


def test_a_parser_built_for_one_command_still_lists_every_command(capsys):
    parser = cli.build_parser(["health", "127.0.0.1:1"])
    args = parser.parse_args(["health", "127.0.0.1:1"])
    assert args.subparser.prog == "paramserve health"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    listed = capsys.readouterr().out
    assert all(command.name in listed for command in cli.SUBCOMMANDS)


def test_a_server_started_by_the_command_imports_neither_the_other_commands_nor_torchmetrics():
    """Each import is seconds of every container's start on a small machine."""
    probe = (
        "import sys; from paramserve.coordinator.commands import cli; cli.build_parser(['ps']); "
        "print([m for m in ('torchmetrics', 'paramserve.worker.__main__', 'paramserve.coordinator.commands.demo') "
        "if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_demo_logs_a_line_per_checkpoint_and_prints_the_status_page_where_users_reach_it() -> None:
    from paramserve.coordinator.commands.demo import advertised, progress_line

    assert progress_line(3000, 30000, 0.01234, 2) == "step 3000/30000 (10%) loss 0.0123, 2 workers; checkpoint saved"
    assert advertised("http://coordinator-x7:8080/?key=abc", "127.0.0.1:8080") == "http://127.0.0.1:8080/?key=abc"
    assert advertised("http://coordinator-x7:8080/?key=abc", None) == "http://coordinator-x7:8080/?key=abc"
    assert advertised(None, "127.0.0.1:8080") is None


def test_sigterm_ends_the_demo_as_ctrl_c_does() -> None:
    """A container's PID 1 ignores SIGTERM unless it handles it: the Job's next pod waited 30 s."""
    import os
    import signal
    import time

    from paramserve.coordinator.commands.demo import exit_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    try:
        exit_on_sigterm()
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the handler runs between bytecodes of this (the main) thread
        assert stopped.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
