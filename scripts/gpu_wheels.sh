#!/usr/bin/env bash
# The packages the GPU check needs that the GPU image lacks, saved as wheels in .whl/ (git-ignored through
# .git/info/exclude): xgrammar for the CUDA tests' JSON mask, with its needs, at the versions installed here; and
# GemLite (pure Python + Triton: needs triton >= 3.6, which the image has), bench/gpu.py's W4A16 peer, built here
# into a wheel from its sdist at GEMLITE_VERSION. A device call then names `.whl` in `carry`; scripts/gpu_check.sh
# installs whatever .whl/ holds before the tests.
#   scripts/gpu_wheels.sh        (here, where pip reaches the registries)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
pkgs=()
for name in xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_wheels: $name is not installed here (scripts/setup.sh first)" >&2; exit 1; }
    pkgs+=("$name==$version")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${pkgs[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "gemlite==${GEMLITE_VERSION:-0.6.0.post2}"
ls .whl
