#!/usr/bin/env bash
# Installs the tools deploy/check.sh runs, on Debian 12 (bookworm) as root:
#   systemd-analyze (systemd), promtool (prometheus), kubectl (kubernetes-client, only when no
#   kubectl is on PATH), kubernetes-validate and PyYAML (PyPI, into the current Python).
# Everything comes from the Debian archive and PyPI. About a minute on a fresh machine.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive

if ! command -v apt-get >/dev/null; then
  echo "install-tools.sh: needs apt-get (Debian or Ubuntu)" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

packages=()
command -v systemd-analyze >/dev/null || packages+=(systemd)
command -v promtool >/dev/null || packages+=(prometheus)
# Debian's kubectl is old (1.20) but its built-in kustomize builds deploy/k8s identically.
command -v kubectl >/dev/null || packages+=(kubernetes-client)
if [ "${#packages[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  # Only the tools are wanted: forbid package scripts from starting services (the prometheus
  # server) while installing, unless the machine already has a policy of its own.
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 0755 "$policy"
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi

"$PYTHON" -m pip install --quiet --disable-pip-version-check "kubernetes-validate>=1.30" "PyYAML>=6"

# Report what is installed (never fail on a version banner).
{ systemd-analyze --version | head -n 1; } || true
{ promtool --version 2>&1 | head -n 1; } || true
{ kubectl version --client 2>/dev/null | head -n 1; } || true
"$PYTHON" -m kubernetes_validate --version || true
