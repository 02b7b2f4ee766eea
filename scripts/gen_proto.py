"""Regenerate (or, with --check, verify) the committed protobuf code.

python scripts/gen_proto.py          # write proto/rematd/v1/*_pb2*.py(i)
python scripts/gen_proto.py --check  # exit 1 when the committed code drifts
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = PROTO_ROOT / "rematd" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    protos = sorted(PACKAGE.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "rematd" / "v1").iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when committed code differs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = [p for p in generate(Path(tmp)) if p.name.endswith(SUFFIXES)]
        drift = []
        for path in generated:
            target = PACKAGE / path.name
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    drift.append(target.relative_to(ROOT))
            else:
                shutil.copyfile(path, target)
        if args.check:
            expected = {p.name for p in generated}
            drift += [
                p.relative_to(ROOT) for p in PACKAGE.iterdir() if p.name.endswith(SUFFIXES) and p.name not in expected
            ]
            if drift:
                print("generated protobuf code is out of date; run: python scripts/gen_proto.py", file=sys.stderr)
                for d in drift:
                    print(f"  {d}", file=sys.stderr)
                return 1
            print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
