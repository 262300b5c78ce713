#!/usr/bin/env bash
# Make Debian's Chromium available for the browser test (tests/service/test_service_mlflow_ui.py).
# Prints the browser's path; exits non-zero with a reason otherwise.
set -euo pipefail
BROWSER=/usr/bin/chromium

if [ ! -x "$BROWSER" ]; then
  bash "$(dirname "$0")/apt_install.sh" chromium
  [ -x "$BROWSER" ] || { echo "apt-get installed chromium but $BROWSER is missing" >&2; exit 1; }
fi
echo "$BROWSER"
