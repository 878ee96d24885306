#!/usr/bin/env bash
# Make a GPU call's saved Triton cache the one the next call carries: usage  bash lab/gpu/tcache_repack.sh DIR
# DIR's tcache.txz.* parts (xz, what gpu_session.sh saves) are copied into .tcache/ after a check that they
# decompress whole; older calls' tcache.tgz.* (gzip) parts are recompressed as xz.
set -euo pipefail
src=${1:?usage: tcache_repack.sh DIR-with-tcache parts}
mkdir -p .tcache
if ls "$src"/tcache.txz.* >/dev/null 2>&1; then
    cat "$src"/tcache.txz.* | xz -t -  # a part that did not come back fails here, before .tcache is touched
    rm -f .tcache/tcache.*
    cp "$src"/tcache.txz.* .tcache/
    echo "copied $(cat .tcache/tcache.txz.* | wc -c) bytes of Triton cache into .tcache/"
    exit 0
fi
ls "$src"/tcache.tgz.* >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src"/tcache.tgz.* | tar -xzf - -C "$tmp"
rm -f .tcache/tcache.*
tar -cf - -C "$tmp" . | xz -T0 -6 | split -b 15M - .tcache/tcache.txz.
echo "repacked $(du -sh "$tmp" | cut -f1) of Triton cache into $(cat .tcache/tcache.txz.* | wc -c) bytes under .tcache/"
