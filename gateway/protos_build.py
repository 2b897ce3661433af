"""Compile protos/ into gateway/_proto with grpcio-tools (`make protos`).

`--check` compiles into a temporary directory and fails if the committed code differs, so
a .proto edited without regenerating is caught by the tests.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "gateway" / "_proto"


def compile_to(out: Path) -> None:
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}",
                        f"--pyi_out={out}", *files])
    if code != 0:
        raise SystemExit(f"protoc failed ({code})")
    for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()


def generated(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*.py*") if p.is_file()}


def stale() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        compile_to(fresh)
        new, old = generated(fresh), generated(OUT)
        diff = sorted(set(new) ^ set(old))
        diff += [k for k in new.keys() & old.keys()
                 if not filecmp.cmp(new[k], old[k], shallow=False)]
        return sorted(diff)


def main() -> int:
    if "--check" in sys.argv:
        bad = stale()
        if bad:
            print("gateway/_proto is stale; run `make protos`:", *bad, sep="\n  ")
            return 1
        print("gateway/_proto is up to date")
        return 0
    compile_to(OUT)
    print(f"compiled {PROTOS} -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
