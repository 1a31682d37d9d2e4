"""deploy/observability: the Prometheus configurations (promtool), a live scrape of every role
(promtool check metrics), and the Grafana dashboard (Grafana's schema, and every query on a
metric paramserve serves); every metric is documented in deploy/README.md."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from paramserve.coordinator.status.telemetry import CoordinatorTelemetry, register_queue_gauges
from paramserve.psserver.server import ServerConfig, build_server
from paramserve.worker.server import WorkerConfig, build_worker

ROOT = pathlib.Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "paramserve.json"
SCHEMA = pathlib.Path(__file__).with_name("grafana-dashboard.schema.json")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)
METRIC = re.compile(r"\b(paramserve_[a-z0-9_]+|up)\b")


# ---------------------------------------------------------------- what paramserve serves


@pytest.fixture(scope="module")
def endpoints() -> Iterator[dict[str, str]]:
    """A parameter server, a worker and a coordinator's telemetry, each serving /metrics."""
    ps = build_server(ServerConfig(host="127.0.0.1", port=0, metrics_port=0))
    worker = build_worker(WorkerConfig(host="127.0.0.1", port=0, metrics_port=0))
    telemetry = CoordinatorTelemetry.build()
    try:
        yield {
            "ps": f"http://127.0.0.1:{ps.metrics_port}/metrics",
            "worker": f"http://127.0.0.1:{worker.metrics_port}/metrics",
            "coordinator": f"http://127.0.0.1:{telemetry.serve('127.0.0.1', 0)}/metrics",
        }
    finally:
        telemetry.close()
        worker.stop(grace=0)
        ps.stop(grace=0)


def families() -> dict[str, str]:
    """Every metric family any paramserve process registers (name -> type), samples or not."""
    registries = [CollectorRegistry(), CollectorRegistry()]
    ps = build_server(ServerConfig(host="127.0.0.1", port=0), registry=registries[0])
    worker = build_worker(WorkerConfig(host="127.0.0.1", port=0), registry=registries[1])
    try:
        coordinator = CoordinatorTelemetry.build().registry
        register_queue_gauges(coordinator, queue_depth=lambda: 0, in_flight=lambda: 0)
        registries.append(coordinator)
        return {family.name: family.type for registry in registries for family in registry.collect()}
    finally:
        worker.stop(grace=0)
        ps.stop(grace=0)


def sample_names(known: dict[str, str]) -> set[str]:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""], "info": ["_info"]}
    return {name + suffix for name, kind in known.items() for suffix in suffixes.get(kind, [""])} | {"up"}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def test_every_role_serves_build_info_and_no_created_series(endpoints: dict[str, str]) -> None:
    for role, url in endpoints.items():
        text = scrape(url)
        assert f'role="{role}"' in text and "paramserve_build_info{" in text, role
        assert "_created" not in text, role


@needs_promtool
def test_promtool_accepts_a_live_scrape_of_every_role(endpoints: dict[str, str]) -> None:
    for role, url in endpoints.items():
        done = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=scrape(url), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{role}: {done.stdout}{done.stderr}"


# ---------------------------------------------------------------- Prometheus


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_promtool_accepts_the_scrape_configurations(config: str) -> None:
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(OBSERVABILITY / config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "config, services",
    [
        (
            "prometheus.yml",
            lambda: set(yaml.safe_load((ROOT / "deploy/compose/docker-compose.yml").read_text())["services"]),
        ),
        (
            "prometheus-k8s.yml",
            lambda: {
                d["metadata"]["name"]
                for f in (ROOT / "deploy/k8s/base").glob("*.yaml")
                for d in yaml.safe_load_all(f.read_text())
                if d and d["kind"] == "Service"
            },
        ),
    ],
)
def test_every_scrape_job_finds_a_service_of_its_deployment_on_the_metrics_port(config: str, services: Any) -> None:
    jobs = yaml.safe_load((OBSERVABILITY / config).read_text())["scrape_configs"]
    assert {job["job_name"] for job in jobs} == {"paramserve-ps", "paramserve-worker", "paramserve-coordinator"}
    for job in jobs:
        for sd in job["dns_sd_configs"]:
            assert sd["port"] == 9100 and set(sd["names"]) <= services(), job["job_name"]


# ---------------------------------------------------------------- Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_is_valid_against_grafana_s_schema(dashboard: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed: pip install -e '.[test]'")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [f"/{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(dashboard)]
    assert not errors, errors
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["gridPos"]["w"] = "8"
    assert list(validator.iter_errors(broken)), "the schema catches a string where Grafana wants a number"


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    for _, expr in targets(dashboard):
        assert set(re.findall(r"\$(\w+)", expr)) <= variables, expr


def test_every_query_reads_metrics_paramserve_serves(dashboard: dict[str, Any]) -> None:
    served = sample_names(families())
    for title, expr in targets(dashboard):
        names = set(METRIC.findall(expr))
        assert names and names <= served, f"{title}: {sorted(names - served)} are served by no paramserve process"


def test_the_dashboard_shows_what_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(expr for _, expr in targets(dashboard))
    for needed in (
        "paramserve_coordinator_steps_total",
        "paramserve_received_bytes_total",
        "paramserve_sent_bytes_total",
        "paramserve_ps_push_staleness_versions_bucket",
        "paramserve_rpc_duration_seconds_bucket",
        'code!="OK"',
        "paramserve_coordinator_workers",
        "paramserve_ps_shard_version",
        "paramserve_coordinator_ps_recoveries_total",
        "paramserve_coordinator_queued_closures",
        "paramserve_coordinator_checkpoint_age_seconds",
        "paramserve_build_info",
        # issue 24: a dynamic table's live rows, memory, admissions and evictions, per server
        "paramserve_ps_dynamic_rows",
        "paramserve_ps_dynamic_bytes",
        "paramserve_ps_dynamic_admissions_total",
        "paramserve_ps_dynamic_evictions_total",
        # issue 23: replicated servers' failovers, replicas in sync, rejoins and their bytes and time
        'result=~"failed-over|replica-lost"',
        "paramserve_coordinator_ps_replicas_in_sync",
        "paramserve_coordinator_ps_replica_rejoins_total",
        "paramserve_coordinator_ps_replica_resync_bytes_total",
        "paramserve_coordinator_ps_replica_resync_seconds_bucket",
    ):
        assert needed in exprs, needed
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


@needs_promtool
def test_promtool_parses_every_query(dashboard: dict[str, Any], tmp_path: pathlib.Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"paramserve:dashboard_query_{i}", "expr": expr.replace("$job", ".*")}
                    for i, (_, expr) in enumerate(targets(dashboard))
                ],
            }
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- documentation


def test_every_metric_is_documented_in_deploy_readme() -> None:
    readme = (ROOT / "deploy" / "README.md").read_text()
    documented = {name + ("_total" if kind == "counter" else ""): kind for name, kind in families().items()}
    missing = sorted(name for name in documented if f"`{name}" not in readme)
    assert not missing, f"deploy/README.md does not document {missing}"
