#!/usr/bin/env bash
# Wheels the H200 image lacks (it has torch 2.11, triton 3.6, transformers 5.17, no fla, no jsonschema, no fastapi).
# Run here (registries reachable), then carry `.whl` in the device call: lab/gpu/gpu_session.sh installs them.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the repository root (this script lives in lab/gpu/)
exclude="$(git rev-parse --git-path info/exclude)"  # a worktree's .git is a file, not a folder
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fla-core==0.6.0 flash-linear-attention==0.6.0 transformers==5.24.0 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 typing_extensions==4.16.0 \
    uvloop==0.23.0 httptools==0.9.0
ls .whl
