#!/usr/bin/env bash
# Make PostgreSQL's server binaries available for tests/service (Debian/Ubuntu: ~8 s).
# Prints the bin directory holding initdb and pg_ctl; exits non-zero with a reason otherwise.
set -euo pipefail

find_bin() {
  if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then
    dirname "$(readlink -f "$(command -v pg_ctl)")"; return 0
  fi
  local dir
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$dir" ] && [ -x "$dir/pg_ctl" ]; then echo "$dir"; return 0; fi
  return 1
}

if find_bin; then exit 0; fi
bash "$(dirname "$0")/apt_install.sh" postgresql
find_bin || { echo "apt-get installed postgresql but no pg_ctl was found" >&2; exit 1; }
