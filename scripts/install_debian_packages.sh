#!/usr/bin/env bash
# Installs those of the named Debian packages that are missing (apt-get,
# through sudo unless root); installs nothing when all are there.
#
#   scripts/install_debian_packages.sh PACKAGE...
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
[ "${#missing[@]}" -gt 0 ] || exit 0
echo "installing Debian packages: ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" = 0 ] || sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
