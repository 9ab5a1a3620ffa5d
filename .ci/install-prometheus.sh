#!/usr/bin/env bash
# Install Debian's prometheus binary for tests/packaging/test_prometheus.py (see install-debian-package.sh).
exec bash "$(dirname "$0")/install-debian-package.sh" prometheus prometheus
