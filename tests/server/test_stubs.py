"""The committed stubs in kvtier/v1 are what the .proto generates (modulo version stamps), and
they load on the oldest supported protobuf runtime."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "kvtier" / "v1" / "kvtier.proto"
STUBS = ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py")
OLDEST_PROTOBUF = (7, 36, 0)

_VERSIONS = [
    (re.compile(r"ValidateProtobufRuntimeVersion\(.*?\)", re.S), "ValidateProtobufRuntime(…)"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: …"),
    (re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M), "GRPC_GENERATED_VERSION = …"),
]


def normalize(text: str) -> str:
    for pattern, repl in _VERSIONS:
        text = pattern.sub(repl, text)
    return text


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(PROTO)],
        check=True,
    )
    for name in STUBS:
        fresh = (tmp_path / "kvtier" / "v1" / name).read_text()
        committed = (ROOT / "kvtier" / "v1" / name).read_text()
        assert normalize(fresh) == normalize(committed), f"{name} is stale: run proto/generate.sh"
    assert (ROOT / "kvtier" / "v1" / "kvtier.proto").read_text() == PROTO.read_text()


def test_stubs_accept_the_oldest_supported_protobuf() -> None:
    gen = (ROOT / "kvtier" / "v1" / "kvtier_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                  r"\s*(\d+),\s*(\d+),\s*(\d+)", gen)
    assert m is not None
    assert tuple(int(g) for g in m.groups()) <= OLDEST_PROTOBUF
    grpc_gen = (ROOT / "kvtier" / "v1" / "kvtier_pb2_grpc.py").read_text()
    g = re.search(r"GRPC_GENERATED_VERSION = '(\d+)\.(\d+)", grpc_gen)
    assert g is not None and (int(g.group(1)), int(g.group(2))) <= (1, 84)
