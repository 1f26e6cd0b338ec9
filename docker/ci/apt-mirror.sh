#!/usr/bin/env bash
# Print the Debian mirror this machine's own apt sources use for SUITE (default bookworm): the first
# `deb` source for that suite, as apt-get itself reads them (/etc/apt/sources.list, sources.list.d/*.list
# and deb822 sources.list.d/*.sources, disabled entries skipped), so no mirror is named in this repository.
# base-image.sh hands it to debootstrap unless MIRROR= is given. Fails, saying so, when there is none.
#   usage: apt-mirror.sh [SUITE]      (APT_CONFIG, apt's own variable, points apt-get at other sources)
set -euo pipefail

suite=${1:-bookworm}

if ! command -v apt-get >/dev/null; then
    echo "apt-mirror: no apt-get here to read apt sources from; give your Debian mirror as MIRROR=..." >&2
    exit 1
fi
# One line per index target, "deb bookworm <its URI>": the suite as written in the sources.
# (--no-release-info: what the sources say, whether or not `apt-get update` ever ran.)
targets=$(apt-get indextargets --no-release-info --format '$(TARGET_OF) $(RELEASE) $(REPO_URI)') || {
    echo "apt-mirror: apt-get could not list this machine's apt sources; give your Debian mirror as MIRROR=..." >&2
    exit 1
}
# debootstrap fetches over http(s) or from a local file: other schemes (cdrom:, tor+, mirror+) are skipped.
mirror=$(awk -v suite="$suite" '$1 == "deb" && $2 == suite && $3 ~ /^(https?|file):/ { print $3; exit }' <<<"$targets")
if [[ -z "$mirror" ]]; then
    echo "apt-mirror: no http(s) or file \`deb\` source for $suite in this machine's apt sources;" \
         "give your Debian mirror as MIRROR=..." >&2
    exit 1
fi
echo "$mirror"
