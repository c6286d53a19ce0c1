#!/usr/bin/env bash
# Installs Debian packages the tests need, through apt-get (and sudo when not root):
#   scripts/apt-install.sh WHO PACKAGE...      # WHO names the caller in messages
set -euo pipefail
who=$1; shift
[ $# -gt 0 ] || exit 0
command -v apt-get >/dev/null || { echo "$who: missing $*, and no apt-get to install them" >&2; exit 1; }
sudo=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "$who: missing $*; installing needs root or sudo" >&2; exit 1; }
  sudo=(sudo)
fi
echo "$who: installing $*" >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
