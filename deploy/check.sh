#!/usr/bin/env bash
# Offline checks of deploy/: generated files up to date, systemd-analyze verify,
# kubernetes-validate --strict, kubectl kustomize, promtool check/test rules.
# Needs the tools from deploy/install-tools.sh; a missing tool fails the run
# (pass --allow-missing to skip those checks instead).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" deploy/checks.py "$@"
