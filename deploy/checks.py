#!/usr/bin/env python3
"""Offline checks of everything in deploy/, shared by ``deploy/check.sh`` and tests/deploy/.

Each check returns a list of problems (empty = pass) and raises :class:`ToolMissing` when the
tool it runs is not installed (``deploy/install-tools.sh`` installs them all). From the command
line every check runs; a missing tool fails the run unless ``--allow-missing`` is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
K8S = DEPLOY / "k8s"
REMOTE = DEPLOY / "k8s-remote"  # the remote-tier overlay (a shared Valkey/Redis)
UNIT = DEPLOY / "systemd" / "kvtier.service"
# Validated by kubernetes-validate; the ServiceMonitor is a CRD with no schema in Kubernetes, and
# the kustomization is not a resource.
NOT_KUBERNETES = {"servicemonitor.yaml", "kustomization.yaml"}
KINDS = {"ConfigMap", "Deployment", "DaemonSet", "Service", "ServiceMonitor"}


class ToolMissing(Exception):
    """The external tool a check needs is not on PATH."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(f"{name} not found (run deploy/install-tools.sh)")
    return path


def _run(cmd: list[str], cwd: Path = ROOT) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def kvtier_command() -> str:
    """The real daemon command here: the ``kvtier`` script, else this Python running the CLI."""
    exe = shutil.which("kvtier")
    return exe if exe else f"{sys.executable} -m kvtier.cli"


def systemd_verify(unit: Path = UNIT) -> list[str]:
    """``systemd-analyze verify`` on a copy whose ExecStart names a binary that exists here.

    verify exits 0 on most problems, so any output at all is a failure.
    """
    analyze = _tool("systemd-analyze")
    text = unit.read_text(encoding="utf-8")
    text, n = re.subn(r"^ExecStart=\S+", f"ExecStart={kvtier_command()}", text, flags=re.M)
    if n != 1:
        return [f"{unit.name}: expected exactly one ExecStart= line, found {n}"]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / unit.name
        copy.write_text(text, encoding="utf-8")
        rc, out = _run([analyze, "verify", str(copy)], cwd=Path(tmp))
    return [f"systemd-analyze verify (rc={rc}): {out}"] if rc or out else []


def kubernetes_manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_KUBERNETES)


def _kubernetes_validate() -> list[str]:
    """The CLI, or the module in this Python when its script is not on PATH."""
    if exe := shutil.which("kubernetes-validate"):
        return [exe]
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return [sys.executable, "-m", "kubernetes_validate"]
    raise ToolMissing("kubernetes-validate not found (run deploy/install-tools.sh)")


def kube_validate(files: list[Path] | None = None) -> list[str]:
    """``kubernetes-validate --strict`` on every manifest; warnings count as failures."""
    targets = [str(p) for p in (files if files is not None else kubernetes_manifests())]
    rc, out = _run([*_kubernetes_validate(), "--strict", "--quiet", *targets])
    return [f"kubernetes-validate (rc={rc}): {out}"] if rc or out else []


def kustomize_build(path: Path = K8S) -> list[str]:
    """``kubectl kustomize`` must succeed, print no warning and emit every expected kind."""
    rc, out = _run([_tool("kubectl"), "kustomize", str(path)])
    if rc:
        return [f"kubectl kustomize (rc={rc}): {out}"]
    kinds = set(re.findall(r"^kind: (\w+)$", out, flags=re.M))
    problems = [f"kubectl kustomize: missing kind {k}" for k in sorted(KINDS - kinds)]
    problems += [f"kubectl kustomize: {line}" for line in out.splitlines() if "Warning" in line]
    return problems


def kustomize_remote(path: Path = REMOTE) -> list[str]:
    """The remote-tier overlay builds; its output (less the schema-less ServiceMonitor) passes
    ``kubernetes-validate --strict``, and the DaemonSet it emits reads the remote settings."""
    rc, out = _run([_tool("kubectl"), "kustomize", str(path)])
    if rc:
        return [f"kubectl kustomize {path.name} (rc={rc}): {out}"]
    problems = [f"kubectl kustomize {path.name}: {line}" for line in out.splitlines()
                if "Warning" in line]
    kinds = set(re.findall(r"^kind: (\w+)$", out, flags=re.M))
    wanted = KINDS | {"StatefulSet"}
    problems += [f"{path.name}: missing kind {k}" for k in sorted(wanted - kinds)]
    for var in ("REMOTE_URL", "REMOTE_PASSWORD_FILE", "REMOTE_SECRET_FILE"):
        if f"name: KVCACHED_OFFLOAD_{var}" not in out:
            problems.append(f"{path.name}: the DaemonSet does not set KVCACHED_OFFLOAD_{var}")
    docs = [d for d in re.split(r"^---$", out, flags=re.M) if "kind: ServiceMonitor" not in d]
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / "remote.yaml"
        built.write_text("---".join(docs), encoding="utf-8")
        problems += kube_validate([built])
    return problems


def promtool_rules() -> list[str]:
    promtool = _tool("promtool")
    problems = []
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        rc, out = _run([promtool, *args], cwd=DEPLOY / "prometheus")
        if rc:
            problems.append(f"promtool {' '.join(args)} (rc={rc}): {out}")
    return problems


def generated_files() -> list[str]:
    """The env file, ConfigMap, config table and dashboard match their generators."""
    problems = []
    for script in ("gen_env.py", "grafana/dashboard.py"):
        rc, out = _run([sys.executable, str(DEPLOY / script), "--check"])
        if rc:
            problems.append(f"{script} --check (rc={rc}): {out}")
    return problems


CHECKS: dict[str, Callable[[], list[str]]] = {
    "generated files": generated_files,
    "systemd-analyze verify": systemd_verify,
    "kubernetes-validate --strict": kube_validate,
    "kubectl kustomize": kustomize_build,
    "remote-tier overlay (kustomize + kubernetes-validate)": kustomize_remote,
    "promtool check/test rules": promtool_rules,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-missing", action="store_true", help="skip checks without tools")
    args = parser.parse_args(argv)
    passed = failed = skipped = 0
    for name, check in CHECKS.items():
        try:
            problems = check()
        except ToolMissing as exc:
            skipped += args.allow_missing
            failed += not args.allow_missing
            print(f"{'SKIP' if args.allow_missing else 'FAIL'} {name}: {exc}")
            continue
        for problem in problems:
            print(f"  {problem}")
        print(f"{'FAIL' if problems else 'ok  '} {name}")
        failed += bool(problems)
        passed += not problems
    print(f"deploy: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
