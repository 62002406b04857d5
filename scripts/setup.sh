#!/usr/bin/env bash
# Create .venv and install varbench with a CPU build of torch where no CUDA is present.
# Idempotent: a second call only checks that the install is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# EXTRAS: the optional-dependency groups (make test: dev,peers); PIN: one more requirement,
# e.g. "transformers==5.0.0" for the lowest-version venv of `make test-compat`.
EXTRAS=${EXTRAS:-dev}
PIN=${PIN:-}
# One stamp per set of extras: `make run` (dev) never stands in for `make test` (dev,peers).
STAMP="$VENV/.varbench-installed-${EXTRAS//,/-}${PIN:+-pinned}"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --quiet)
TORCH_VERSION=2.13.0
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    :
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" install "torch==$TORCH_VERSION"
else
    # No CUDA: a CPU wheel on local find-links (this machine and CI) wins; otherwise take
    # PyTorch's CPU index so pip never downloads a multi-GB CUDA build.
    if ! "${PIP[@]}" install --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
        "${PIP[@]}" install "torch==$TORCH_VERSION" \
            --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    fi
    "${PIP[@]}" install "torch==$TORCH_VERSION"  # pulls torch's own dependencies
fi
"${PIP[@]}" install -e ".[$EXTRAS]" $PIN
case ",$EXTRAS," in
    *,peers,*) "${PIP[@]}" install --no-deps "verl==0.9.1" ;;  # deps: the peers extra
esac
touch "$STAMP"
