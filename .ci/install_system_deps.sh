#!/usr/bin/env bash
# Install the system packages the test beds need (tests/support/beds/): FUSE + sshfs for the
# NFS-like stale-cache bed, an OpenSSH server for sshfs to talk to, libfuse 3 for the
# power-loss bed (mfusepy loads libfuse3.so.3 with ctypes).
# Idempotent and fast when everything is already there: apt is only touched when a
# needed command is missing. Non-interactive; needs root (CI and dev machines run as root).
set -euo pipefail

need=()
command -v sshfs >/dev/null 2>&1 || need+=(sshfs)
{ command -v fusermount3 >/dev/null 2>&1 || command -v fusermount >/dev/null 2>&1; } || need+=(fuse3)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
{ ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so\.3 ' || [ -e /lib/x86_64-linux-gnu/libfuse3.so.3 ] \
    || [ -e /usr/lib/x86_64-linux-gnu/libfuse3.so.3 ]; } || need+=(libfuse3-3)

if [ ${#need[@]} -eq 0 ]; then
    echo "install_system_deps: sshfs, fuse3, libfuse3-3, openssh-server already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi  # never prompt for a password
export DEBIAN_FRONTEND=noninteractive
echo "install_system_deps: installing ${need[*]}"
# --no-install-recommends keeps it small (no xauth, ncurses-term, ...).
# policy-rc.d-free: sshd is never started as a system service by the tests, and
# service start failures in containers are harmless, so ignore them.
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian package may have started a system sshd on port 22 where an init system
# exists; the beds do not use it (they run their own sshd on a free loopback port).
echo "install_system_deps: done"
