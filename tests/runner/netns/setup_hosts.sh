#!/usr/bin/env bash
# Install what the multi-host tests (tests/runner/test_ssh_hosts.py) need to fake several hosts on one machine:
# iproute2 (ip netns, veth, bridge), util-linux (unshare, for a hostname per host) and openssh-server (sshd).
# Debian/Ubuntu, as root.  Idempotent; the test fixture runs it by itself when sshd is missing, and .ci/run may
# call it up front.  Nothing is started or configured here: the fixture (tests/runner/netns/cluster.py) creates
# the namespaces, keys and sshd processes in a temporary directory and removes them again.
set -euo pipefail
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
if [ ${#need[@]} -eq 0 ]; then
    echo "setup_hosts: iproute2, unshare and openssh are already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_hosts: missing ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
timeout 300 apt-get update -qq
# policy-rc.d in containers keeps the package from starting a system sshd; we never use one.
timeout 300 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "setup_hosts: installed ${need[*]}"
