#!/usr/bin/env bash
# The GPU harness on a bare GPU box (PyTorch, no network): install the wheels kept in .whl/, run the harness.
#   bench/gpu/run.sh OUT_DIR [harness options: --only CASE,... --budget-s 540 --tiny --dry-run]
# Results: OUT_DIR/results.json (rewritten after every case). See bench/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/gpu/run.sh OUT_DIR [harness options]}
shift
py=${PYTHON:-python3}
site=${VLMEXP_SITE:-/tmp/vlmexp-site}
if compgen -G ".whl/*.whl" >/dev/null; then
  # --no-deps: .whl/ holds exactly what the box lacks or has too old (README: the list); --target keeps the
  # box's own torch, torchvision and CUDA libraries untouched. DeepSpeed's sdist is installed by the harness.
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" bench/gpu/harness.py "$out" "$@"
