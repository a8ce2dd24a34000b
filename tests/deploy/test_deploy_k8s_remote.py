"""The remote-tier overlay (deploy/k8s-remote): builds, validates strictly, wires the settings."""

from __future__ import annotations

from typing import Any

import pytest
from deploy_helpers import checks, run_check

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (deploy/install-tools.sh)")


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((checks.REMOTE / name).read_text()) if d]


def test_overlay_builds_and_validates_strictly() -> None:
    assert run_check(checks.kustomize_remote) == []


def test_patch_passes_secrets_privately_and_names_every_setting() -> None:
    (patch,) = _docs("daemonset-remote.yaml")
    pod = patch["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert "-m 0600" in init["command"][-1] and "-o 1000" in init["command"][-1]
    env = {e["name"].removeprefix("KVCACHED_OFFLOAD_"): e for e in pod["containers"][0]["env"]}
    assert env["REMOTE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "kvtier-remote"
    assert {"REMOTE_PASSWORD_FILE", "REMOTE_SECRET_FILE"} <= set(env)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvtier-remote"]["emptyDir"]["medium"] == "Memory"  # never on a node's disk


def test_example_store_is_a_bounded_cache_with_an_acl() -> None:
    config, service, stateful = _docs("valkey.yaml")
    conf = config["data"]["valkey.conf"]
    assert "maxmemory-policy allkeys-lru" in conf and 'save ""' in conf and "aclfile" in conf
    assert service["kind"] == "Service" and stateful["kind"] == "StatefulSet"
    limits = stateful["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "26Gi"  # maxmemory 24gb plus headroom
