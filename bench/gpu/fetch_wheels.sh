#!/usr/bin/env bash
# Download, on a machine with PyPI, what bench/gpu/run.sh installs on a GPU box that has none: Python 3.12
# manylinux x86_64 wheels (and DeepSpeed's sdist) at the versions constraints.txt pins, into .whl/ (git-ignored).
#   bench/gpu/fetch_wheels.sh [EXTRA_NAME ...]      e.g. pyarrow if the box's pyarrow is older than 24
set -euo pipefail
cd "$(dirname "$0")/../.."
# a Python with torch (the project's venv): pip reads DeepSpeed's sdist metadata by running its setup.py, which imports torch
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
# Missing on the GPU image (shared/NOTES.md "A GPU machine as seen here") or older there than this project needs.
names=(transformers tokenizers trl peft datasets dill multiprocess fsspec regex pydantic pydantic_core annotated-types
       typing-inspection typing_extensions math-verify latex2sympy2_extended antlr4-python3-runtime hjson "$@")
pins=()
for name in "${names[@]}"; do
  pin=$(grep -iE "^${name//[-_]/[-_]}==" constraints.txt || true)
  [ -n "$pin" ] || { echo "no pin for $name in constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
# DeepSpeed ships as source only; the harness builds it there with DS_BUILD_OPS=0 (no CUDA ops compiled).
"$py" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d .whl "$(grep -i '^deepspeed==' constraints.txt)"
ls -l .whl && du -sh .whl
