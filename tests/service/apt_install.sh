#!/usr/bin/env bash
# Install Debian packages that tests need on the machine (PostgreSQL, Chromium). The package
# lists are refreshed only when a first install attempt fails. Usage: apt_install.sh PACKAGE...
set -euo pipefail
if ! command -v apt-get >/dev/null; then
  echo "apt-get is unavailable: install $* by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
# One install at a time: `make test` runs two pytest workers, and dpkg's own lock fails fast.
exec 9>"${TMPDIR:-/tmp}/csx-apt-install.lock"
flock 9
$SUDO apt-get install -y -q "$@" >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "$@" >/dev/null
}
