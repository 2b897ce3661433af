"""Driving loadgen.py, the load generator, from a benchmark: one long-lived worker process
(its own CPU, its own interpreter), one JSON job line in, one result line out."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class LoadGen:
    """benchmarks/loadgen.py as a long-lived worker: one JSON job line in, one result out."""

    def __init__(self, cpus: set[int] | None, log_path: Path) -> None:
        argv = [sys.executable, str(HERE / "loadgen.py")]
        if cpus:
            argv += ["--cpus", ",".join(map(str, sorted(cpus)))]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)

    def run(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"load generator gave no answer within {timeout:.0f}s "
                               f"(see {self._log.name})")
        result: dict[str, Any] = json.loads(line)
        if "fatal" in result:
            raise RuntimeError(f"load generator failed: {result['fatal']}")
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"kind": "quit"}\n')
                self.proc.stdin.flush()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
