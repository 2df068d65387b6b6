#!/usr/bin/env bash
# Install Debian's chromium and chromium-driver (the `kvrescue view` browser test drives them through selenium)
# when either is missing; quiet, and nothing to do when both are present. Needs root (or sudo) and apt-get.
set -euo pipefail
command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
if ! command -v apt-get >/dev/null; then
    echo "scripts/browser.sh: no apt-get here; install chromium and chromium-driver by hand (the browser test skips)" >&2
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get -qq -o DPkg::Lock::Timeout=600 update
$sudo apt-get -qq -o DPkg::Lock::Timeout=600 install -y --no-install-recommends chromium chromium-driver >/dev/null
