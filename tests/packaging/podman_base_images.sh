#!/usr/bin/env bash
# Make the base images the Dockerfile needs when no container registry is reachable (podman set up
# with runtime = "runc" and cgroup_manager = "cgroupfs" where crun cannot run):
# localhost/debian:bookworm from debootstrap, then a stand-in tagged
# docker.io/library/python:3.11-slim so an unmodified `FROM python:3.11-slim` resolves locally.
# Idempotent: an image that already exists is kept. Run as root, with podman and debootstrap.
set -euo pipefail

if ! podman image exists localhost/debian:bookworm; then
    workdir=$(mktemp -d)
    trap 'rm -rf "$workdir"' EXIT
    rootfs=$workdir/rootfs
    # The host's own apt mirror (deb822 sources here), since deb.debian.org may be unreachable.
    mirror=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
    debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}"
    # The host's CA bundle, or HTTPS from RUN steps (pip) fails certificate checks behind a proxy.
    mkdir -p "$rootfs/usr/local/share/ca-certificates" "$rootfs/etc/ssl/certs"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    tar -C "$rootfs" --exclude='./var/cache/apt/archives/*.deb' -c . \
        | podman import --change 'CMD ["/bin/bash"]' - localhost/debian:bookworm
fi

if ! podman image exists docker.io/library/python:3.11-slim; then
    context=$(mktemp -d)
    # Like the official image: Python 3.11 with its headers (torch's C++ extension build needs
    # Python.h), pip and venv at /usr/local/bin, no EXTERNALLY-MANAGED marker.
    cat > "$context/Containerfile" <<'CONTAINERFILE'
FROM localhost/debian:bookworm
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/python3 /usr/local/bin/python \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
ENV DEBIAN_FRONTEND=
CMD ["python3"]
CONTAINERFILE
    podman build --isolation chroot --network host --format docker \
        -t docker.io/library/python:3.11-slim "$context"
    rm -rf "$context"
fi
