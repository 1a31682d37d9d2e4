"""The coordinator's metrics (coordinator.telemetry) and what every endpoint serves (metrics_http)."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue, ClosureState
from paramserve.coordinator.status.telemetry import CheckpointRecord, CoordinatorTelemetry, register_queue_gauges
from paramserve.psserver.runtime.metrics_http import WithoutCreated, register_build_info, serve_metrics


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def telemetry(**overrides: object) -> CoordinatorTelemetry:
    built = CoordinatorTelemetry.build(**overrides)  # type: ignore[arg-type]
    register_queue_gauges(built.registry, queue_depth=lambda: 3, in_flight=lambda: 2)
    return built


def test_closures_are_counted_through_the_queue() -> None:
    t = telemetry()
    queue = ClosureQueue(10, observer=t)
    closures = [Closure("step", b"", steps=4) for _ in range(3)]
    for closure in closures:
        queue.put(closure, timeout=1.0)
    taken = queue.take("w:1", 2)
    queue.succeed(taken[0], 1.0)
    t.closure_retried(taken[1], "UNAVAILABLE")
    queue.close(RuntimeError("stop"))  # the rest are cancelled
    r = t.registry
    assert sample(r, "paramserve_coordinator_closures_scheduled_total") == 3
    assert sample(r, "paramserve_coordinator_closures_finished_total", {"outcome": "succeeded"}) == 1
    assert sample(r, "paramserve_coordinator_steps_total") == 4
    assert sample(r, "paramserve_coordinator_closures_retried_total", {"code": "UNAVAILABLE"}) == 1
    assert sample(r, "paramserve_coordinator_queued_closures") == 3  # read at scrape time
    assert sample(r, "paramserve_coordinator_closures_in_flight") == 2
    assert closures[2].state is ClosureState.CANCELLED
    assert sample(r, "paramserve_coordinator_closures_finished_total", {"outcome": "cancelled"}) >= 1


def test_the_queue_gauges_join_the_registry_the_telemetry_is_built_on() -> None:
    registry = CollectorRegistry()
    t = CoordinatorTelemetry.build(registry=registry)
    assert t.registry is registry
    assert sample(registry, "paramserve_coordinator_queued_closures") is None, "the queue's own, registered apart"
    queue = ClosureQueue(10, observer=t)
    register_queue_gauges(registry, queue_depth=lambda: queue.num_queued, in_flight=lambda: queue.num_in_flight)
    queue.put(Closure("step", b""), timeout=1.0)
    assert sample(registry, "paramserve_coordinator_queued_closures") == 1
    assert sample(registry, "paramserve_coordinator_closures_in_flight") == 0
    assert sample(registry, "paramserve_coordinator_closures_scheduled_total") == 1


def test_workers_by_state_and_membership_changes() -> None:
    t = telemetry()
    t.worker_state("a:1", "up")
    t.worker_state("b:1", "up")
    t.worker_state("b:1", "down")
    r = t.registry
    assert sample(r, "paramserve_coordinator_workers", {"state": "up"}) == 1
    assert sample(r, "paramserve_coordinator_workers", {"state": "down"}) == 1
    assert sample(r, "paramserve_coordinator_worker_up", {"worker": "b:1"}) == 0
    t.worker_state("b:1", None)
    assert sample(r, "paramserve_coordinator_worker_up", {"worker": "b:1"}) is None
    assert sample(r, "paramserve_coordinator_worker_membership_changes_total", {"change": "joined"}) == 2
    assert sample(r, "paramserve_coordinator_worker_membership_changes_total", {"change": "left"}) == 1


def test_checkpoint_age_is_absent_before_the_first_then_counts_from_its_write() -> None:
    record: list[CheckpointRecord | None] = [None]
    t = telemetry(checkpoint=lambda: record[0], clock=lambda: 1000.0)
    assert sample(t.registry, "paramserve_coordinator_checkpoint_age_seconds") is None
    record[0] = CheckpointRecord(step=400, path="/checkpoints/ckpt-400", written_at=990.0)
    assert sample(t.registry, "paramserve_coordinator_checkpoint_age_seconds") == 10.0
    assert sample(t.registry, "paramserve_coordinator_checkpoint_step") == 400


def test_parameter_server_recoveries_are_counted_and_timed() -> None:
    t = telemetry()
    t.parameter_server_recovered("ps1:5000", "restored", 2.5)
    t.parameter_server_recovered("ps1:5000", "failed", 0.5)
    r = t.registry
    assert sample(r, "paramserve_coordinator_ps_recoveries_total", {"server": "ps1:5000", "result": "restored"}) == 1
    assert sample(r, "paramserve_coordinator_ps_recoveries_total", {"server": "ps1:5000", "result": "failed"}) == 1
    assert sample(r, "paramserve_coordinator_ps_recovery_seconds_count") == 2
    assert sample(r, "paramserve_coordinator_ps_recovery_seconds_sum") == 3.0


def test_the_endpoint_serves_build_info_and_no_created_series() -> None:
    t = telemetry()
    port = t.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        t.close()
    assert t.port is None
    assert "paramserve_build_info{" in text and 'role="coordinator"' in text
    assert "paramserve_coordinator_closures_scheduled_total 0.0" in text
    assert "_created" not in text


def test_without_created_leaves_the_registry_and_other_registries_alone() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()
    Histogram("seconds", "Seconds.", registry=registry).observe(1)
    register_build_info(registry, "ps")
    assert b"things_created" in generate_latest(registry)  # prometheus_client's own default, untouched
    served = generate_latest(WithoutCreated(registry)).decode()
    assert "_created" not in served and "things_total 1.0" in served and "seconds_count 1.0" in served
    endpoint = serve_metrics(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10) as reply:
            assert b"_created" not in reply.read()
    finally:
        endpoint.stop()
