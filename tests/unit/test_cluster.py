"""ClusterSpec / TaskSpec: parsing, validation (each error names the problem and the fix), precedence."""

from __future__ import annotations

import json
import logging

import pytest

from paramserve.coordinator.cluster import (
    ClusterSpec,
    ClusterSpecError,
    TaskSpec,
    parse_address,
)

DOC_TF_CONFIG = {
    "cluster": {
        "worker": ["host1:2222", "host2:2222", "host3:2222"],
        "ps": ["host4:2222", "host5:2222"],
    },
    "task": {"type": "worker", "index": 1},
}


def tf_config(cluster: object, task: object = None) -> str:
    top: dict[str, object] = {"cluster": cluster}
    if task is not None:
        top["task"] = task
    return json.dumps(top)


# ------------------------------------------------------------------ parse_address


@pytest.mark.parametrize(
    "text, expected",
    [
        ("localhost:2222", ("localhost", 2222)),
        ("10.0.0.5:80", ("10.0.0.5", 80)),
        ("ps-0.train_job.svc.cluster.local:65535", ("ps-0.train_job.svc.cluster.local", 65535)),
        ("  host:1  ", ("host", 1)),
        ("[::1]:2222", ("::1", 2222)),
        ("[2001:db8::7]:8470", ("2001:db8::7", 8470)),
        ("[fe80::1%eth0]:9000", ("fe80::1%eth0", 9000)),
    ],
)
def test_parse_address_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text, problem, fix",
    [
        ("host:abc", "not an integer", "1..65535"),
        ("host:-1", "not an integer", "1..65535"),
        ("host:+80", "not an integer", "1..65535"),
        ("host:8o", "not an integer", "1..65535"),
        ("host:0", "port 0", "port the server actually listens on"),
        ("host:65536", "out of range", "1..65535"),
        ("host:99999999", "out of range", "1..65535"),
        (":2222", "no host", "10.0.0.5:2222"),
        ("[]:2222", "no host", "[::1]:2222"),
        ("host", "no port", "host:2222"),
        ("host:", "no port", "host:2222"),
        ("[::1]", "no port", "host:2222"),
        ("[::1]:", "no port", "host:2222"),
        ("::1:2222", "IPv6 address without brackets", "[::1]:2222"),
        ("[myhost]:2222", "not an IPv6 address", "hostname:2222"),
        ("[::1:2222", "malformed", "[::1]:2222"),
        ("grpc://host:2222", "not a hostname", "no scheme or path"),
        ("ho st:2222", "whitespace", "remove it"),
        ("", "empty address", "host:port"),
    ],
)
def test_parse_address_rejects_with_fix(text: str, problem: str, fix: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_address(text)
    assert problem in str(info.value)
    assert fix in str(info.value)


def test_parse_address_rejects_non_string() -> None:
    with pytest.raises(ClusterSpecError, match=r"not a string.*host:port"):
        parse_address(2222)  # type: ignore[arg-type]


def test_cluster_spec_error_is_a_value_error() -> None:
    assert issubclass(ClusterSpecError, ValueError)


# ------------------------------------------------------------------ ClusterSpec


def test_cluster_spec_counts_and_tf_config_cluster() -> None:
    spec = ClusterSpec(("ps0:1", "ps1:1"), ("w0:1", "w1:1", "w2:1"), chief="chief:1")
    assert spec.num_ps() == 2
    assert spec.num_workers() == 3
    assert spec.as_tf_config_cluster() == {
        "ps": ["ps0:1", "ps1:1"],
        "worker": ["w0:1", "w1:1", "w2:1"],
        "chief": ["chief:1"],
    }


def test_tf_config_cluster_round_trips_and_omits_absent_chief() -> None:
    spec = ClusterSpec(("ps0:1",), ("[::1]:5",))
    cluster = spec.as_tf_config_cluster()
    assert "chief" not in cluster
    assert ClusterSpec.from_tf_config(json.dumps({"cluster": cluster})) == spec


def test_cluster_spec_is_frozen_hashable_and_takes_lists() -> None:
    spec = ClusterSpec(["ps0:1"], [" w0:1 "])  # type: ignore[arg-type]
    assert spec.parameter_servers == ("ps0:1",)
    assert spec.workers == ("w0:1",)
    assert hash(spec) == hash(ClusterSpec(("ps0:1",), ("w0:1",)))
    with pytest.raises(AttributeError):
        spec.workers = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    "ps, workers, chief, problem, fix",
    [
        ((), ("w:1",), None, "no parameter servers", "at least one host:port"),
        (("p:1",), (), None, "no workers", "at least one host:port"),
        (("p:1", "p:1"), ("w:1",), None, "appears twice (ps[0] and ps[1])", "change one of them"),
        (("p:1",), ("w:1", "p:1"), None, "appears twice (ps[0] and worker[1])", "change one of them"),
        (("p:1",), ("w:1",), "w:1", "appears twice (worker[0] and chief)", "change one of them"),
        (("[::1]:7",), ("[0:0::1]:7",), None, "appears twice", "change one of them"),
        (("Host.Example:7",), ("host.example:7",), None, "appears twice", "change one of them"),
        (("p:0",), ("w:1",), None, "ps[0]: address 'p:0'", "port the server actually listens on"),
        ("p:1", ("w:1",), None, "must be a tuple", "('p:1',)"),
        (("p:1",), ("w:1", 7), None, 'only "host:port" strings', "ClusterSpec.workers"),
    ],
)
def test_cluster_spec_rejects_with_fix(ps: object, workers: object, chief: str | None, problem: str, fix: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec(ps, workers, chief)  # type: ignore[arg-type]
    assert problem in str(info.value)
    assert fix in str(info.value)


def test_same_host_different_ports_is_fine() -> None:
    spec = ClusterSpec(("127.0.0.1:1", "127.0.0.1:2"), ("127.0.0.1:3",))
    assert spec.num_ps() == 2


# ------------------------------------------------------------------ TF_CONFIG


def test_from_tf_config_reads_the_guide_example() -> None:
    text = json.dumps(DOC_TF_CONFIG)
    spec = ClusterSpec.from_tf_config(text)
    assert spec == ClusterSpec(("host4:2222", "host5:2222"), ("host1:2222", "host2:2222", "host3:2222"))
    assert TaskSpec.from_tf_config(text) == TaskSpec("worker", 1)


def test_from_tf_config_reads_chief_and_ipv6() -> None:
    text = tf_config({"chief": ["[::1]:1"], "ps": ["[::1]:2"], "worker": ["[::1]:3"]}, {"type": "chief"})
    spec = ClusterSpec.from_tf_config(text)
    assert spec.chief == "[::1]:1"
    assert parse_address(spec.workers[0]) == ("::1", 3)
    assert TaskSpec.from_tf_config(text) == TaskSpec("chief", 0)  # TensorFlow defaults the index to 0


def test_from_tf_config_ignores_evaluator_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    text = tf_config({"ps": ["p:1"], "worker": ["w:1"], "evaluator": ["e:1"]}, {"type": "evaluator", "index": 0})
    with caplog.at_level(logging.INFO, logger="paramserve.coordinator.cluster"):
        spec = ClusterSpec.from_tf_config(text)
    assert spec == ClusterSpec(("p:1",), ("w:1",))
    assert "e:1" not in json.dumps(spec.as_tf_config_cluster())
    assert any("evaluator job" in r.getMessage() for r in caplog.records)
    assert TaskSpec.from_tf_config(text) == TaskSpec("evaluator", 0)


def test_task_is_optional() -> None:
    assert TaskSpec.from_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1"]})) is None
    assert TaskSpec.from_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {})) is None


@pytest.mark.parametrize(
    "text, problem, fix",
    [
        ("{not json", "not valid JSON", "set it to a JSON object such as"),
        ("[1, 2]", "must be a JSON object, got a list", '"cluster"'),
        (tf_config(["p:1"]), "cluster must be a JSON object", "e.g."),
        (tf_config({"ps": "p:1", "worker": ["w:1"]}), "cluster.ps must be a list", '"ps": ["10.0.0.2:2222"]'),
        (tf_config({"ps": ["p:1"], "worker": [2222]}), "cluster.worker must be a list", "e.g."),
        (tf_config({"ps": ["p:1"], "worker": {"0": "w:1"}}), "cluster.worker must be a list", "e.g."),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"], "trainer": ["t:1"]}),
            "unknown role 'trainer'",
            "allowed roles are chief, worker, ps, evaluator",
        ),
        (tf_config({"ps": ["p:1"], "worker": ["w:1"], "master": ["m:1"]}), "unknown role 'master'", "called 'chief'"),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"], "chief": ["c:1", "c:2"]}),
            "chief has 2 entries",
            "move the others to cluster.worker",
        ),
        (tf_config({"worker": ["w:1"]}), "no parameter servers", "TF_CONFIG cluster.ps"),
        (tf_config({"ps": ["p:1"], "worker": []}), "no workers", "TF_CONFIG cluster.worker"),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1", "w:x"]}),
            "TF_CONFIG cluster.worker[1]",
            "fix it in TF_CONFIG cluster.worker",
        ),
        (tf_config({"ps": ["p:1"], "worker": ["p:1"]}), "appears twice", "change one of them"),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "ps", "index": 1}),
            "index 1 is out of range for job 'ps'",
            "fix task.index or add the address to cluster.ps",
        ),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "chief", "index": 0}),
            "task type 'chief' is not a job of its cluster",
            "add cluster.chief or fix task.type",
        ),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "boss", "index": 0}),
            "type 'boss' is not a role",
            "use one of chief, worker, ps, evaluator",
        ),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "worker", "index": -1}),
            "index -1 is not a non-negative integer",
            "write a number such as 0",
        ),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "worker", "index": "0"}),
            "index '0' is not a non-negative integer",
            '(not "0")',
        ),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "worker", "index": True}),
            "index True is not a non-negative integer",
            "write a number",
        ),
        (tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"index": 0}), "has no 'type'", "add one"),
        (
            tf_config({"ps": ["p:1"], "worker": ["w:1"]}, ["worker", 0]),
            "task must be a JSON object",
            '{"type": "worker", "index": 0}',
        ),
    ],
)
def test_from_tf_config_rejects_with_fix(text: str, problem: str, fix: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.from_tf_config(text)
    assert problem in str(info.value)
    assert fix in str(info.value)


def test_task_spec_validates_itself() -> None:
    with pytest.raises(ClusterSpecError, match="use one of"):
        TaskSpec("boss", 0)
    with pytest.raises(ClusterSpecError, match="non-negative"):
        TaskSpec("worker", -2)


def test_task_spec_from_env() -> None:
    assert TaskSpec.from_env({"TF_CONFIG": json.dumps(DOC_TF_CONFIG)}) == TaskSpec("worker", 1)
    assert TaskSpec.from_env({}) is None
    assert TaskSpec.from_env({"TF_CONFIG": ""}) is None


# ------------------------------------------------------------------ from_env precedence

ENV_PS = "envps:1,envps:2"
ENV_WORKERS = "envw:1"
TF_TEXT = tf_config(
    {"ps": ["tfps:1"], "worker": ["tfw:1", "tfw:2"], "chief": ["tfchief:1"]}, {"type": "chief", "index": 0}
)


def test_flags_win_over_env_and_tf_config() -> None:
    environ = {"PARAMSERVE_PS": ENV_PS, "PARAMSERVE_WORKERS": ENV_WORKERS, "TF_CONFIG": TF_TEXT}
    spec = ClusterSpec.from_env({"ps": ["flagps:1"], "workers": ["flagw:1"], "chief": "flagchief:1"}, environ)
    assert spec == ClusterSpec(("flagps:1",), ("flagw:1",), "flagchief:1")


def test_env_wins_over_tf_config() -> None:
    environ = {"PARAMSERVE_PS": ENV_PS, "PARAMSERVE_WORKERS": ENV_WORKERS, "TF_CONFIG": TF_TEXT}
    spec = ClusterSpec.from_env(None, environ)
    assert spec == ClusterSpec(("envps:1", "envps:2"), ("envw:1",), "tfchief:1")


def test_tf_config_is_the_last_resort() -> None:
    spec = ClusterSpec.from_env({}, {"TF_CONFIG": TF_TEXT})
    assert spec == ClusterSpec(("tfps:1",), ("tfw:1", "tfw:2"), "tfchief:1")


def test_precedence_is_per_field() -> None:
    environ = {"PARAMSERVE_WORKERS": ENV_WORKERS, "TF_CONFIG": TF_TEXT}
    spec = ClusterSpec.from_env({"ps": "flagps:1, flagps:2", "unrelated_flag": 3}, environ)
    assert spec.parameter_servers == ("flagps:1", "flagps:2")
    assert spec.workers == ("envw:1",)
    assert spec.chief == "tfchief:1"


def test_none_flags_and_empty_env_count_as_unset() -> None:
    environ = {"PARAMSERVE_PS": "", "PARAMSERVE_WORKERS": "  ", "TF_CONFIG": TF_TEXT}
    spec = ClusterSpec.from_env({"ps": None, "workers": None, "chief": None}, environ)
    assert spec == ClusterSpec(("tfps:1",), ("tfw:1", "tfw:2"), "tfchief:1")


def test_env_only_with_ipv6() -> None:
    spec = ClusterSpec.from_env(None, {"PARAMSERVE_PS": "[::1]:5000", "PARAMSERVE_WORKERS": "[::1]:5001,[::1]:5002"})
    assert spec == ClusterSpec(("[::1]:5000",), ("[::1]:5001", "[::1]:5002"))
    assert spec.chief is None


def test_flag_lists_may_hold_comma_separated_items() -> None:
    spec = ClusterSpec.from_env({"ps": ["a:1,b:1", "c:1"], "workers": ("w:1",)}, {})
    assert spec.parameter_servers == ("a:1", "b:1", "c:1")


@pytest.mark.parametrize(
    "flags, environ, problem, fix",
    [
        ({}, {}, "no cluster description", "set PARAMSERVE_PS and PARAMSERVE_WORKERS"),
        (
            {},
            {"PARAMSERVE_PS": "p:1"},
            "no workers (looked in flag workers, PARAMSERVE_WORKERS, PARAMSERVE_WORKER_SERVICE or TF_CONFIG",
            "give at least one host:port",
        ),
        (
            {},
            {"PARAMSERVE_WORKERS": "w:1"},
            "no parameter servers (looked in flag ps, PARAMSERVE_PS",
            "give at least one host:port",
        ),
        ({"ps": [], "workers": ["w:1"]}, {}, "no parameter servers (looked in flag ps)", "at least one"),
        (
            {},
            {"PARAMSERVE_PS": "p:1,,p:2", "PARAMSERVE_WORKERS": "w:1"},
            "PARAMSERVE_PS='p:1,,p:2' has an empty entry",
            'write "host1:port,host2:port"',
        ),
        ({}, {"PARAMSERVE_PS": "p:1", "PARAMSERVE_WORKERS": "w:1,"}, "empty entry", "host1:port,host2:port"),
        (
            {},
            {"PARAMSERVE_PS": "p:1,p:70000", "PARAMSERVE_WORKERS": "w:1"},
            "PARAMSERVE_PS[1]",
            "fix it in PARAMSERVE_PS",
        ),
        ({"ps": ["p:1"], "workers": ["w"]}, {}, "flag workers[0]", "fix it in flag workers"),
        ({"ps": 5, "workers": ["w:1"]}, {}, "flag ps must be a list", "comma-separated string"),
        ({"ps": ["p:1"], "workers": ["w:1"], "chief": ["c:1"]}, {}, "flag chief is a list", 'one "host:port"'),
        ({}, {"PARAMSERVE_PS": "p:1", "PARAMSERVE_WORKERS": "p:1"}, "appears twice", "change one of them"),
        (
            {"ps": ["p:1"], "workers": ["w:1"]},
            {"TF_CONFIG": "{oops"},
            "TF_CONFIG is not valid JSON",
            "set it to a JSON object",
        ),
        (
            {},
            {"PARAMSERVE_PS": "p:1", "TF_CONFIG": tf_config({"ps": ["x:1"]})},
            "no workers",
            "TF_CONFIG cluster.worker",
        ),
    ],
)
def test_from_env_rejects_with_fix(flags: dict, environ: dict, problem: str, fix: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.from_env(flags, environ)
    assert problem in str(info.value)
    assert fix in str(info.value)


def test_from_env_logs_where_each_field_came_from(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="paramserve.coordinator.cluster"):
        ClusterSpec.from_env({"ps": ["p:1"]}, {"PARAMSERVE_WORKERS": "w:1"})
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "from flag ps" in message and "from PARAMSERVE_WORKERS" in message


def test_tensorflows_cluster_spec_spelling_builds_the_same_cluster():
    jobs = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"], "chief": ["127.0.0.1:4"]}
    assert ClusterSpec({**jobs, "evaluator": ["127.0.0.1:5"]}) == ClusterSpec(
        ("127.0.0.1:1",), ("127.0.0.1:2", "127.0.0.1:3"), chief="127.0.0.1:4"
    )
    with pytest.raises(ClusterSpecError, match="mapping alone"):
        ClusterSpec(jobs, workers=("127.0.0.1:9",))
    with pytest.raises(ClusterSpecError, match=r"jobs \['trainer'\]"):
        ClusterSpec({**jobs, "trainer": ["127.0.0.1:6"]})
    with pytest.raises(ClusterSpecError, match="2 chiefs"):
        ClusterSpec({**jobs, "chief": ["127.0.0.1:4", "127.0.0.1:7"]})
