#!/usr/bin/env bash
# Install what is missing for `make run` / `make test` on a fresh machine:
# Debian's redis-server (the tests start their own on free ports) and a venv in .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "bootstrap: installing redis-server (Debian)"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip 2>/dev/null
fi
echo "bootstrap: installing the gateway package and its dev/test extras"
.venv/bin/pip install -q -e '.[dev,test]' 2>&1 | grep -v "^WARNING: Location" || true
# devspoke/ (`gateway dev`) and testkit/ are not in the package: the venv imports them from
# this checkout, as the tests and the benchmarks do.
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
pwd > "$SITE/gateway-checkout.pth"
.venv/bin/python -c "import gateway, devspoke, testkit, grpc, envoy.service.auth.v3.external_auth_pb2, aiohttp, openai
from gateway.server.proto_fields import check_or_exit; check_or_exit()"
