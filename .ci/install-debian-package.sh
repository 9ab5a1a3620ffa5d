#!/usr/bin/env bash
# Usage: install-debian-package.sh COMMAND PACKAGE
# Install a Debian package for the tests that need its COMMAND (prometheus for
# tests/packaging/test_prometheus.py, docker-compose for tests/deploy/test_compose.py), without
# starting any service it ships. Idempotent: does nothing when COMMAND is already on PATH. Needs
# root (or sudo); elsewhere the test that needs it skips with a message.
set -euo pipefail
command_name="$1"
package="$2"

if command -v "$command_name" >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-debian-package: no apt-get here; install $package yourself" >&2
    exit 0  # the test then skips with a message; not every developer machine is Debian
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! sudo -n true 2>/dev/null; then
        echo "install-debian-package: not root and no passwordless sudo; the tests needing $package skip" >&2
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

if ! apt-cache policy "$package" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $sudo apt-get update -qq
fi
# No recommends: they pull in services (node-exporter for prometheus, docker.io for docker-compose).
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null
command -v "$command_name"
