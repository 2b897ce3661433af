"""Package-level import graph of gateway: which subpackage (or top-level module) imports
which, and which outside packages the core reaches (grpc, protobuf, Envoy protos).

    .venv/bin/python scripts/import_graph.py
"""

from __future__ import annotations

import sys
from collections import defaultdict

import grimp

WATCHED = ("grpc", "google.protobuf", "envoy", "xds", "udpa", "prometheus_client")


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def main() -> int:
    graph = grimp.build_graph("gateway", include_external_packages=True)
    edges: dict[str, set[str]] = defaultdict(set)
    for importer in graph.modules:
        if not importer.startswith("gateway"):
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            a = unit(importer)
            if imported.startswith("gateway"):
                b = unit(imported)
                if a != b and b != "gateway":
                    edges[a].add(b)
            elif imported.split(".")[0] in {w.split(".")[0] for w in WATCHED}:
                edges[a].add(f"[{imported}]")
    for a in sorted(edges):
        print(f"{a:28} -> {', '.join(sorted(edges[a]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
