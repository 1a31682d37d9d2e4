"""Regenerates the Python code for every .proto under proto/ (with type stubs).

Run from anywhere: ``python proto/generate.py``. The output sits beside the
sources (proto/paramserve/wire/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py) and is
committed; tests/unit/test_generated_code.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate_into(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc on every source, writing under out_dir; returns the files written."""
    import importlib.resources

    from grpc_tools import protoc  # imported here: only needed to regenerate

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_sources()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = pathlib.Path(tmp)
        for generated in generate_into(tmp_dir):
            target = PROTO_ROOT / generated.relative_to(tmp_dir)
            shutil.copyfile(generated, target)
            print(f"wrote {target.relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
