"""Kubernetes manifests validate strictly, build with kustomize, and keep the CUDA IPC rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import checks, run_check

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (deploy/install-tools.sh)")
K8S = checks.K8S


def _load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((K8S / name).read_text())
    assert isinstance(doc, dict)
    return doc


def _pod(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _load(name)["spec"]["template"]["spec"]
    return spec


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def test_kubernetes_validate_strict() -> None:
    assert run_check(checks.kube_validate) == []


def test_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (K8S / "sidecar.yaml").read_text()
    bad.write_text(text.replace("shareProcessNamespace:", "shareProcessNamespaces:"))
    assert run_check(checks.kube_validate, [bad]) != []


def test_kubectl_kustomize_builds_every_kind() -> None:
    assert run_check(checks.kustomize_build) == []


def test_kustomization_resources_exist_and_parse() -> None:
    # Runs without kubectl: the same contract, minus kustomize's own transformations.
    kustomization = _load("kustomization.yaml")
    kinds = set()
    for name in kustomization["resources"]:
        kinds.add(_load(name)["kind"])
    assert kinds == checks.KINDS
    listed = set(kustomization["resources"]) | checks.NOT_KUBERNETES
    assert {p.name for p in K8S.glob("*.yaml")} <= listed


def test_sidecar_shares_gpu_uid_pid_namespace_and_socket() -> None:
    pod = _pod("sidecar.yaml")
    containers = _containers(pod)
    kvtier, engine = containers["kvtier"], containers["engine"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    for c in containers.values():
        assert "runAsUser" not in c.get("securityContext", {}), c["name"]
        assert "/run/kvtier" in {m["mountPath"] for m in c["volumeMounts"]}
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(kvtier.get("resources", {}))
    env = {e["name"]: e["value"] for e in kvtier["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["kvtier-run"]


@pytest.mark.parametrize("manifest", ["sidecar.yaml", "daemonset.yaml"])
def test_grpc_probes_hit_a_port_the_daemon_listens_on(manifest: str) -> None:
    data = _load("configmap.yaml")["data"]
    listen = data["KVCACHED_OFFLOAD_LISTEN"].split(",")
    kvtier = _containers(_pod(manifest))["kvtier"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = kvtier[probe]["grpc"]["port"]
        # The kubelet probes the pod IP, so a 127.0.0.1 listener would never answer.
        assert f"0.0.0.0:{port}" in listen, (probe, listen)
    assert data["KVCACHED_OFFLOAD_TOKEN_FILE"].startswith("/etc/kvtier/token/")
    assert data["KVCACHED_OFFLOAD_METRICS_ADDR"] == "0.0.0.0:9464"


def test_daemonset_uses_host_socket_dir_and_keeps_disk_tier() -> None:
    pod = _pod("daemonset.yaml")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvtier-run"]["hostPath"]["path"] == "/run/kvtier"
    assert volumes["kvtier-disk"]["hostPath"]["path"] == "/var/lib/kvtier"
    assert pod["hostPID"] is True


def test_service_monitor_scrapes_the_metrics_port() -> None:
    service, monitor = _load("service.yaml"), _load("servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    assert wanted <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert service["metadata"]["name"] == "kvtier"  # becomes job="kvtier" for the alerts
