#!/usr/bin/env bash
# The etcd server for the multi-host tests (tests/multihost): Debian's etcd-server (etcd 3.4). Quick when it is
# already there. Needs root (apt-get); without root it says so and leaves the tests to skip (or fail in CI).
# The etcd client library comes with the main venv (kvlifecycle[dev] includes kvlifecycle[etcd]).
set -euo pipefail
log() { printf '[setup-etcd %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if command -v etcd >/dev/null 2>&1 && command -v iptables >/dev/null 2>&1; then
    log "ready: $(etcd --version | head -n1)"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    log "etcd or iptables is missing and installing them needs root: apt-get install etcd-server iptables"
    exit 0
fi
log "installing etcd-server and iptables (the partition tests drop packets with it)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends etcd-server iptables >/dev/null
# the package enables a system service; the tests start their own etcd, so stop one that may have started
if command -v systemctl >/dev/null 2>&1; then systemctl stop etcd >/dev/null 2>&1 || true; fi
log "ready: $(etcd --version | head -n1)"
