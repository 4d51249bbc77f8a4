"""Regenerate quicksilver_pb2.py / quicksilver_pb2_grpc.py from quicksilver.proto (needs grpcio-tools).

    python -m runtime.server.proto.generate [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "runtime/server/proto/quicksilver.proto"


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    code = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / PROTO)])
    if code != 0:
        raise SystemExit(f"protoc failed with code {code}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
