#!/usr/bin/env bash
# chromium.sh finds the Chromium the console's browser tests drive
# (console/internal/browser), and prints its path. `make browser` runs it,
# and `make test` with it.
#
#   bash scripts/chromium.sh       find or install Chromium, print its path
#
#   CHROMIUM=path                  use that browser
#
# Which browser: CHROMIUM, else chromium or chromium-browser on PATH or in
# /usr/bin. Failing those, as root on Debian or Ubuntu (CI on a fresh
# machine) it installs Debian's chromium package with apt-get (running
# `apt-get update` first when apt cannot find it); else it exits non-zero
# after saying what to install. Nothing is written into the repository.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf 'chromium: %s\n' "$*" >&2; }

# bounded SECS CMD [ARG...]
source "$root/scripts/lib.sh"

find_chromium() {
	local c
	if [[ -n ${CHROMIUM:-} ]]; then
		[[ -x $CHROMIUM ]] && printf '%s\n' "$CHROMIUM" && return 0
		say "CHROMIUM=$CHROMIUM is not an executable"
		return 2
	fi
	for c in chromium chromium-browser /usr/bin/chromium /usr/bin/chromium-browser; do
		if command -v "$c" >/dev/null 2>&1; then
			command -v "$c"
			return 0
		fi
	done
	return 1
}

find_chromium
case $? in
0) exit 0 ;;
2) exit 1 ;;
esac

if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
	say "no Chromium found; installing Debian's chromium package with apt-get (a few minutes on a fresh machine)"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-cache show chromium >/dev/null 2>&1; then
		bounded 300 apt-get update -qq >&2 || say "apt-get update failed"
	fi
	if bounded 900 apt-get install -y -qq --no-install-recommends chromium >&2; then
		find_chromium && exit 0
	fi
	say "apt-get install chromium failed"
fi
say "no Chromium: install it (Debian, Ubuntu: apt-get install chromium; macOS: brew install --cask chromium) or set CHROMIUM=path"
exit 1
