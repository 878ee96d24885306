#!/usr/bin/env bash
# Turn a GPU call's saved Triton cache ($OUT/tcache.tgz.*, gzip parts written by gpu_session.sh on exit) into
# .tcache/tcache.txz.* (xz, 15 MB parts) for the next call to carry: usage  bash scripts/tcache_repack.sh DIR
set -euo pipefail
src=${1:?usage: tcache_repack.sh DIR-with-tcache.tgz-parts}
ls "$src"/tcache.tgz.* >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src"/tcache.tgz.* | tar -xzf - -C "$tmp"
mkdir -p .tcache
rm -f .tcache/tcache.*
tar -cf - -C "$tmp" . | xz -T0 -6 | split -b 15M - .tcache/tcache.txz.
echo "repacked $(du -sh "$tmp" | cut -f1) of Triton cache into $(cat .tcache/tcache.txz.* | wc -c) bytes under .tcache/"
