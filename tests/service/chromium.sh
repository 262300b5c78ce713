#!/usr/bin/env bash
# Make Debian's Chromium available for the browser test (tests/service/test_service_mlflow_ui.py).
# Prints the browser's path; exits non-zero with a reason otherwise.
set -euo pipefail
BROWSER=/usr/bin/chromium

if [ -x "$BROWSER" ]; then echo "$BROWSER"; exit 0; fi
if ! command -v apt-get >/dev/null; then
  echo "Chromium is not installed and apt-get is unavailable: install Debian's chromium ($BROWSER)" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null
}
[ -x "$BROWSER" ] || { echo "apt-get installed chromium but $BROWSER is missing" >&2; exit 1; }
echo "$BROWSER"
