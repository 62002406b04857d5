#!/usr/bin/env bash
# Create .venv and install varbench: a CPU build of torch where no CUDA is present, a CUDA
# build where nvidia-smi sees a GPU (then checked: torch.cuda.is_available() must be True).
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
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# A CUDA machine: nvidia-smi runs. TORCH_INDEX_URL picks a CUDA build other than PyPI's
# default one (e.g. https://download.pytorch.org/whl/cu126 for an older driver).
HAS_CUDA=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    HAS_CUDA=1
fi
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    :
elif [ "$HAS_CUDA" = 1 ]; then
    # PyPI's Linux torch wheel is a CUDA build; an explicit index wins when one is given.
    "${PIP[@]}" install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple}
else
    # No CUDA: a CPU wheel on local find-links (this machine and CI) wins; otherwise take
    # PyTorch's CPU index so pip never downloads a multi-GB CUDA build.
    if ! "${PIP[@]}" install --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
        "${PIP[@]}" install "torch==$TORCH_VERSION" \
            --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    fi
    "${PIP[@]}" install "torch==$TORCH_VERSION"  # pulls torch's own dependencies
fi
if [ "$HAS_CUDA" = 1 ]; then
    # A GPU is here: the torch in the venv must see it (not a CPU build, not a CUDA build
    # newer than the driver), or every command would silently run on the CPU.
    if ! "$VENV/bin/python" -c "
import sys, torch
ok = torch.cuda.is_available()
print(f'torch {torch.__version__} (CUDA build: {torch.version.cuda}); '
      f'torch.cuda.is_available() = {ok}')
sys.exit(0 if ok else 1)"; then
        DRIVER=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
        echo "scripts/setup.sh: error: nvidia-smi sees a GPU (driver's CUDA ${DRIVER:-unknown})" \
             "but torch in $VENV cannot use it (a CPU build, or a CUDA build newer than the" \
             "driver). Remove $VENV and rerun with TORCH_INDEX_URL set to a matching CUDA" \
             "index, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126" >&2
        exit 1
    fi
fi
"${PIP[@]}" install -e ".[$EXTRAS]" $PIN
case ",$EXTRAS," in
    *,peers,*) "${PIP[@]}" install --no-deps "verl==0.9.1" ;;  # deps: the peers extra
esac
touch "$STAMP"
