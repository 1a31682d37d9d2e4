"""deploy/k8s: every manifest valid against Kubernetes 1.30's strict schemas, offline
(kubernetes-validate carries them), and shaped as deploy/README.md says; the overlays rendered by
kubectl's kustomize as a user applies them. On a real cluster: test_k8s_cluster.py."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from paramserve.coordinator.commands.cli import build_parser

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install -e '.[test]' brings it"
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"
K8S = DEPLOY / "base"
VERSION = "1.30.0"
TOKEN_DIR = "/var/run/secrets/paramserve"


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def by_kind(kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, container) of every workload."""
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"], c)
        for d in manifests()
        if d["kind"] in ("StatefulSet", "Deployment", "Job")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_every_file_is_listed_and_every_manifest_is_valid_strictly() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for doc in manifests():
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises ValidationError


def test_the_validator_refuses_unknown_fields_and_kinds() -> None:
    ps = by_kind("StatefulSet", "ps")
    ps["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["initialDelay"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ps, VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="Statefulset"):
        kubernetes_validate.validate({**by_kind("StatefulSet", "ps"), "kind": "Statefulset"}, VERSION, strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**by_kind("StatefulSet", "ps"), "kind": "NoSuchKind"}, VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_the_kustomize_base_renders_every_manifest_and_the_token_secret(tmp_path: pathlib.Path) -> None:
    docs = render(tmp_path, "")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        [(d["kind"], d["metadata"]["name"]) for d in manifests()] + [("Secret", "paramserve-token")]
    )
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"token"}
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "paramserve"
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_parameter_servers_are_a_statefulset_behind_a_headless_service_named_in_the_cluster_spec() -> None:
    ps, service = by_kind("StatefulSet", "ps"), by_kind("Service", "ps")
    assert ps["spec"]["serviceName"] == "ps" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == ps["spec"]["template"]["metadata"]["labels"]
    env = {
        e["name"]: e.get("value")
        for e in by_kind("Job", "coordinator")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PARAMSERVE_PS"] == ",".join(f"ps-{i}.ps:5000" for i in range(ps["spec"]["replicas"]))
    assert env["PARAMSERVE_WORKER_SERVICE"] == "worker:6000"


def test_workers_scale_and_are_found_through_their_headless_service() -> None:
    worker, service = by_kind("Deployment", "worker"), by_kind("Service", "worker")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses")  # only ready workers get closures
    assert service["spec"]["selector"] == worker["spec"]["template"]["metadata"]["labels"]


def test_the_coordinator_is_a_job_with_the_checkpoint_claim_and_the_token_is_a_generated_secret() -> None:
    job = by_kind("Job", "coordinator")
    pod = job["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [by_kind("PersistentVolumeClaim", "checkpoints")["metadata"]["name"]]
    assert pod["securityContext"]["fsGroup"] == 10001  # the image's user can write the volume
    [generator] = yaml.safe_load((K8S / "kustomization.yaml").read_text())["secretGenerator"]
    assert (generator["name"], generator["files"]) == ("paramserve-token", ["token=paramserve_token.txt"])
    assert generator["options"]["disableNameSuffixHash"] is True  # the manifests name it
    assert "deploy/k8s/base/paramserve_token.txt" in (ROOT / ".gitignore").read_text()


def test_every_container_is_non_root_has_requests_native_grpc_probes_and_the_token_file() -> None:
    parser = build_parser()
    for name, pod, container in containers():
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        args = parser.parse_args(container["args"])
        assert str(args.token_file) == f"{TOKEN_DIR}/token" and args.metrics_port == 9100, name
        token_volumes = [
            v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "paramserve-token"
        ]
        assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] in token_volumes] == [TOKEN_DIR]
        if name != "coordinator":
            port = args.port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"] == {"port": port}, f"{name} {probe}"


def test_the_coordinators_status_page_is_a_named_port_of_its_service() -> None:
    [container] = by_kind("Job", "coordinator")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert (args.status_host, args.status_port, args.no_status_page) == ("0.0.0.0", 8080, False)
    assert args.token_file, "beyond the pod's loopback the page asks for the key derived from the token"
    assert {"name": "status", "containerPort": 8080} in container["ports"]
    service_ports = by_kind("Service", "coordinator")["spec"]["ports"]
    assert {"name": "status", "port": 8080, "targetPort": "status"} in service_ports


def render(tmp_path: pathlib.Path, overlay: str) -> list[dict[str, Any]]:
    """deploy/k8s/OVERLAY as ``kubectl kustomize`` renders it, with the token file the README has
    you write (a copy: the repository's own file is never touched)."""
    tree = tmp_path / "k8s"
    if not tree.exists():
        shutil.copytree(DEPLOY, tree, ignore=shutil.ignore_patterns("paramserve_token.txt"))
        (tree / "base" / "paramserve_token.txt").write_text("0123456789abcdef\n")
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(tree / overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d]


def rendered_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_no_overlay_lives_inside_the_base() -> None:
    """kustomize refuses an overlay inside its own base ("cycle detected"): overlays sit beside base/."""
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text()).get("resources", []):
            target = (kustomization.parent / resource).resolve()
            assert not kustomization.parent.resolve().is_relative_to(target), (kustomization, resource)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_the_replicated_overlay_runs_four_servers_in_groups_of_two(tmp_path: pathlib.Path) -> None:
    """deploy/k8s/replicated, rendered as `kubectl apply -k` does: the base with four servers and the
    coordinator told them and the replica count; every object stays valid."""
    from paramserve.coordinator.recovery.replica_groups import group_servers, replica_count

    docs = render(tmp_path, "replicated")
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)
    ps, job = rendered_kind(docs, "StatefulSet", "ps"), rendered_kind(docs, "Job", "coordinator")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    values = {name: e["value"] for name, e in env.items() if "value" in e}
    assert values["PARAMSERVE_PS"] == ",".join(f"ps-{i}.ps:5000" for i in range(ps["spec"]["replicas"]))
    groups = group_servers(values["PARAMSERVE_PS"].split(","), replica_count(None, values))
    assert len(groups) == 2 and all(len(group) == 2 for group in groups)


EPHEMERAL = (32768, 60999)
"""Linux's default net.ipv4.ip_local_port_range: where gloo's pairs and the rendezvous store listen."""


def pods_named(peer: dict[str, Any]) -> str:
    """The job's pods a policy's peer admits (only pod selectors by name: no namespace, no CIDR)."""
    assert set(peer) == {"podSelector"}, peer
    return str(peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"])


def test_network_policies_admit_only_the_jobs_pods_to_the_workers_and_the_rendezvous_store() -> None:
    """Hybrid training's gloo connections are unauthenticated (ARCHITECTURE.md, "Trust model"): the
    workers' ports and the coordinator's store admit only this job's pods; metrics and the status
    page stay open to Prometheus and port-forwards."""
    worker, coordinator = by_kind("NetworkPolicy", "worker-ingress"), by_kind("NetworkPolicy", "coordinator-ingress")
    for policy, pods in ((worker, by_kind("Deployment", "worker")), (coordinator, by_kind("Job", "coordinator"))):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["podSelector"]["matchLabels"] == pods["spec"]["template"]["metadata"]["labels"]

    def admitted(policy: dict[str, Any]) -> dict[tuple[Any, Any], set[str] | None]:
        """(port, endPort) -> the pods admitted to it (None: anyone)."""
        rules: dict[tuple[Any, Any], set[str] | None] = {}
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["protocol"] == "TCP"
                rules[(port["port"], port.get("endPort"))] = (
                    {pods_named(peer) for peer in rule["from"]} if "from" in rule else None
                )
        return rules

    assert admitted(worker) == {("grpc", None): {"coordinator"}, EPHEMERAL: {"worker"}, ("metrics", None): None}
    assert admitted(coordinator) == {EPHEMERAL: {"worker"}, ("metrics", None): None, ("status", None): None}
    servers = by_kind("NetworkPolicy", "ps-ingress")
    assert (
        servers["spec"]["podSelector"]["matchLabels"]
        == by_kind("StatefulSet", "ps")["spec"]["template"]["metadata"]["labels"]
    )
    job = {"coordinator", "worker", "ps"}
    assert admitted(servers) == {("grpc", None): job, ("dataplane", None): job, ("metrics", None): None}
    named = {p["name"] for _, _, c in containers() for p in c.get("ports", [])}
    assert {"grpc", "metrics", "status"} <= named  # the policies' named ports exist


NODE_CPU_MILLIS = 2000
"""The smallest node the defaults must fit: ../shared/k8s's, where the whole layout runs."""


def millicpu(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def requested(docs: list[dict[str, Any]], workers: int) -> int:
    """Millicpus the layout in ``docs`` requests with ``workers`` workers."""
    total = 0
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment", "Job"):
            count = workers if doc["kind"] == "Deployment" else doc["spec"].get("replicas", 1)
            for container in doc["spec"]["template"]["spec"]["containers"]:
                total += count * millicpu(container["resources"]["requests"]["cpu"])
    return total


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_the_default_requests_fit_one_two_cpu_node_and_the_large_overlay_sizes_them_up(tmp_path: pathlib.Path) -> None:
    """The base and the replicated overlay, with the workers scaled to 4, fit a 2-CPU node (the
    scheduler places nothing whose requests do not fit); deploy/k8s/large asks for whole CPUs."""
    base, replicated, large = render(tmp_path, ""), render(tmp_path, "replicated"), render(tmp_path, "large")
    assert requested(replicated, workers=4) <= NODE_CPU_MILLIS < requested(large, workers=1)
    assert requested(base, workers=4) < requested(replicated, workers=4)
    assert rendered_kind(large, "Deployment", "worker")["spec"]["replicas"] == 8
    for doc in large:
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_servers_and_the_coordinator_go_before_the_workers_and_servers_leave_one_at_a_time() -> None:
    classes = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "PriorityClass"}
    priority = {name: pod.get("priorityClassName") for name, pod, _ in containers()}
    assert priority == {
        "ps": "paramserve-critical",
        "worker": "paramserve-worker",
        "coordinator": "paramserve-critical",
    }
    assert classes["paramserve-critical"]["value"] > classes["paramserve-worker"]["value"]
    assert classes["paramserve-worker"]["preemptionPolicy"] == "Never"  # a worker never evicts a server
    assert not any(c.get("globalDefault") for c in classes.values())  # other workloads keep their priority
    budget = by_kind("PodDisruptionBudget", "ps")
    assert budget["spec"]["maxUnavailable"] == 1
    assert (
        budget["spec"]["selector"]["matchLabels"]
        == by_kind("StatefulSet", "ps")["spec"]["template"]["metadata"]["labels"]
    )


def test_startup_probes_wait_for_torch_and_allow_a_busy_node_time_to_answer() -> None:
    for name, _, container in containers():
        if "startupProbe" in container:
            probe = container["startupProbe"]
            assert probe["timeoutSeconds"] >= 5 and probe.get("initialDelaySeconds", 0) >= 3, name
            assert probe["periodSeconds"] * probe["failureThreshold"] >= 120, name


def test_the_claim_takes_the_default_storage_class_and_an_overlay_can_name_one(tmp_path: pathlib.Path) -> None:
    """deploy/README.md, "Storage": no class in the base (the cluster's default); the README's overlay
    names one."""
    assert "storageClassName" not in by_kind("PersistentVolumeClaim", "checkpoints")["spec"]
    readme = (ROOT / "deploy" / "README.md").read_text()
    [overlay] = [block for block in readme.split("```") if block.startswith("yaml\n# deploy/k8s/fast-storage")]
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (its kustomize) is not installed")
    render(tmp_path, "")  # the copy of deploy/k8s
    (tmp_path / "k8s" / "fast-storage").mkdir()
    (tmp_path / "k8s" / "fast-storage" / "kustomization.yaml").write_text(overlay.removeprefix("yaml\n"))
    docs = render(tmp_path, "fast-storage")
    assert rendered_kind(docs, "PersistentVolumeClaim", "checkpoints")["spec"]["storageClassName"] == "fast-ssd"


def test_the_coordinator_job_trains_long_enough_to_scale_and_keeps_checkpoints_per_job() -> None:
    """Retries of one Job resume (the same uid); a new Job trains afresh; long enough that scaling
    during training can be followed (a line per checkpoint in kubectl logs -f)."""
    [container] = by_kind("Job", "coordinator")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.checkpoint_dir == "/checkpoints/$(JOB_UID)" and not args.quiet
    assert args.steps >= 10 * args.checkpoint_every and args.status_address == "127.0.0.1:8080"
    [uid] = [e for e in container["env"] if e["name"] == "JOB_UID"]
    assert uid["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
