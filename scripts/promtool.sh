#!/usr/bin/env bash
# promtool.sh checks the example alerting rules of docs/alerts with
# Prometheus's promtool: `promtool check rules` on the rules, then
# `promtool test rules` on their unit tests. `make alerts` runs it, and
# `make test` with it.
#
#   bash scripts/promtool.sh           check and test docs/alerts
#   bash scripts/promtool.sh install   only find or fetch promtool, and print its path
#
#   PROMTOOL=path          use that promtool
#   PROMTOOL_DIR=dir       where a fetched promtool is kept
#                          (default: ${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/promtool)
#
# Which promtool: PROMTOOL, else promtool on PATH (Debian and Ubuntu:
# apt-get install prometheus; macOS: brew install prometheus), else the
# one fetched before into PROMTOOL_DIR. Failing those, on Debian or
# Ubuntu it fetches Debian's prometheus package with `apt-get download`
# (no install: no service is set up or started, no root needed) and keeps
# only its promtool, a static binary, in PROMTOOL_DIR; if apt cannot find
# the package and this runs as root (CI on a fresh machine), it runs
# `apt-get update` first. Nothing is written into the repository.
# Exits non-zero, after saying what to install, when there is no
# promtool, and when a check or a test fails.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${PROMTOOL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/promtool}

say() { printf 'promtool: %s\n' "$*" >&2; }

# bounded SECS CMD [ARG...]
source "$root/scripts/lib.sh"

# fetch: Debian's promtool into $dir/promtool.
fetch() {
	local tmp deb
	command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 1
	mkdir -p "$dir" || return 1
	tmp=$(mktemp -d "$dir/fetch.XXXXXX") || return 1
	# apt's download sandbox (the _apt user) writes into tmp.
	chmod 777 "$tmp"
	say "fetching Debian's prometheus package for its promtool: apt-get download prometheus"
	if ! (cd "$tmp" && bounded 300 apt-get download prometheus >"$tmp/apt.log" 2>&1); then
		if [[ $(id -u) == 0 ]]; then
			say "apt-get download failed; updating the package lists: apt-get update"
			bounded 300 apt-get update >>"$tmp/apt.log" 2>&1
			(cd "$tmp" && bounded 300 apt-get download prometheus >>"$tmp/apt.log" 2>&1)
		fi
	fi
	deb=$(ls "$tmp"/prometheus_*.deb 2>/dev/null | head -n 1)
	if [[ -z $deb ]]; then
		sed 's/^/  apt: /' "$tmp/apt.log" >&2
		rm -rf "$tmp"
		return 1
	fi
	if ! dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/bin/promtool; then
		rm -rf "$tmp"
		return 1
	fi
	mv "$tmp/usr/bin/promtool" "$dir/promtool" && rm -rf "$tmp"
}

# find: prints the path of a working promtool, fetching one if needed.
find_promtool() {
	local p
	for p in "${PROMTOOL:-}" "$(command -v promtool 2>/dev/null)" "$dir/promtool"; do
		if [[ -n $p && -x $p ]] && "$p" --version >/dev/null 2>&1; then
			printf '%s\n' "$p"
			return
		fi
		if [[ -n $p && $p == "${PROMTOOL:-}" ]]; then
			say "PROMTOOL=$p does not run"
			return 1
		fi
	done
	if fetch && "$dir/promtool" --version >/dev/null 2>&1; then
		printf '%s\n' "$dir/promtool"
		return
	fi
	say "no promtool: the alerting rules of docs/alerts cannot be checked. Install it with:"
	say "  apt-get install prometheus   (Debian, Ubuntu; as root: sudo apt-get install prometheus)"
	say "  brew install prometheus      (macOS)"
	say "or set PROMTOOL=/path/to/promtool"
	return 1
}

promtool=$(find_promtool) || exit 1
if [[ ${1:-} == install ]]; then
	printf '%s\n' "$promtool"
	exit 0
fi
say "$("$promtool" --version 2>&1 | head -n 1)"
cd "$root/docs/alerts" || exit 1
"$promtool" check rules amqpidem.rules.yml && "$promtool" test rules amqpidem.rules_test.yml
