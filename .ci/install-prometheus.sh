#!/usr/bin/env bash
# Install Debian's prometheus binary for tests/packaging/test_prometheus.py, without starting the
# service. Idempotent: does nothing when `prometheus` is already on PATH. Needs root (or sudo).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: no apt-get here; install Prometheus >= 2.x yourself" >&2
    exit 0  # the test then skips with a message; not every developer machine is Debian
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! sudo -n true 2>/dev/null; then
        echo "install-prometheus: not root and no passwordless sudo; the Prometheus test will skip" >&2
        exit 0
    fi
    sudo="sudo"
fi

# policy-rc.d exit code 101 tells invoke-rc.d not to start the daemon the package installs.
policy=/usr/sbin/policy-rc.d
created_policy=""
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    created_policy=1
fi
cleanup() { if [ -n "$created_policy" ]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT

if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $sudo apt-get update -qq
fi
# No recommends: they pull in node-exporter and its own service.
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus
