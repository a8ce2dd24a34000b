#!/usr/bin/env bash
# Regenerates the committed Python stubs in kvtier/v1/ from proto/kvtier/v1/*.proto.
#
# The stubs must load on the oldest supported runtime (grpcio 1.84, protobuf 7.36.0), so generate
# them with grpcio-tools 1.84.0: newer tools stamp a newer protobuf minimum into the gencode.
# Usage: proto/generate.sh [python]   (python: an interpreter with grpcio-tools installed)
set -euo pipefail
PY="${1:-python}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
"$PY" -m grpc_tools.protoc -Iproto \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    proto/kvtier/v1/kvtier.proto
cp proto/kvtier/v1/kvtier.proto kvtier/v1/kvtier.proto
touch kvtier/v1/__init__.py kvtier/v1/py.typed
"$PY" - <<'PYEOF'
import re, pathlib
gen = pathlib.Path("kvtier/v1/kvtier_pb2.py").read_text()
m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", gen)
print("gencode requires protobuf runtime >=", ".".join(m.groups()) if m else "(no check)")
PYEOF
