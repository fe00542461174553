#!/bin/sh
# Debian's Chromium for the real-browser test (make test-browser). Playwright's own browser
# download does not work on machines without general network access, so the test drives the
# system Chromium (/usr/bin/chromium). Installs it only when it is missing; needs root or sudo.
set -eu

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser_setup: $CHROMIUM is missing and apt-get is not available;" >&2
    echo "install Chromium and set CHROMIUM=/path/to/chromium" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "browser_setup: installing Debian's chromium (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
"$CHROMIUM" --version
