#!/bin/bash
# Envoy's preStop hook (deploy/sidecar-with-envoy.yaml): stop the spoke's Envoy drained.
#  1. fail its health checks (the pod has already left the Service's endpoints, so no new
#     requests come; the listeners are NOT drained: measured, Envoy 1.40's graceful drain
#     cuts an HTTP/1.1 stream in flight within a second);
#  2. let the requests in flight finish, up to DRAIN_S seconds (default 30);
#  3. wait a second more, so the access logger sends the records of the last requests
#     (buffered 50 ms) to the sidecar, which outlives Envoy.
# Streams still running after DRAIN_S are cut by Envoy's exit: their records may be lost,
# and the orphan sweep of any sidecar of the spoke bills each from its last heartbeat
# (docs/request-flow.md "Every admission ends"). Needs only bash (/dev/tcp): Envoy's image has no curl.
set -u
ADMIN=${ENVOY_ADMIN:-127.0.0.1:9901}
BOUND=${DRAIN_S:-30}

admin() {  # METHOD PATH: the admin's answer on stdout
  exec 3<>"/dev/tcp/${ADMIN%:*}/${ADMIN##*:}" || return 1
  printf '%s %s HTTP/1.1\r\nHost: envoy\r\nConnection: close\r\n\r\n' "$1" "$2" >&3
  cat <&3
  exec 3<&-
}

in_flight() {  # downstream_rq_active, less the admin's own (this very request is one)
  admin GET '/stats?filter=^http\..*downstream_rq_active$' \
    | awk -F': ' '/downstream_rq_active/ && !/^http\.admin\./ {n += $2} END {print n + 0}'
}

admin POST /healthcheck/fail >/dev/null || exit 0  # Envoy is gone
end=$((SECONDS + BOUND))
while [ "$SECONDS" -lt "$end" ] && [ "$(in_flight)" != 0 ]; do
  sleep 0.5
done
left=$(in_flight)
echo "envoy-prestop: drained; ${left:-?} requests still in flight after at most ${BOUND}s"
sleep 1
