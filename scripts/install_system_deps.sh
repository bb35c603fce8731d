#!/usr/bin/env bash
# System packages the test suite starts for real: chromium (the timeline page is rendered in a
# real headless browser), etcd-server (the etcd-v2 rendezvous against a real 3-member
# cluster), util-linux and passwd (tmpfs mounts, prlimit, a second user). Slurm is installed
# by its own fixture (scripts/slurm/slurm-up.sh). Debian/Ubuntu as root: installs what is
# missing; otherwise says what it skipped and exits 0 (those tests then skip with a reason,
# or fail in CI where the packages must be there).
set -euo pipefail
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v etcd >/dev/null || need+=(etcd-server)
command -v prlimit >/dev/null || need+=(util-linux)
command -v useradd >/dev/null || need+=(passwd)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_system_deps: not root or no apt-get; missing: ${need[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/tmp/install_system_deps.log 2>&1 \
  || { tail -20 /tmp/install_system_deps.log >&2; exit 1; }
echo "install_system_deps: installed ${need[*]}"
