#!/usr/bin/env bash
# Create .venv and install varbench: a CPU build of torch where no CUDA is present, a CUDA
# build where nvidia-smi sees a GPU (then checked: torch.cuda.is_available() must be True).
# Idempotent: a second call only checks that the install is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# EXTRAS: the optional-dependency groups (make test: dev,peers; none: the package alone);
# PIN: one more requirement, e.g. "transformers==5.0.0" for the lowest-version venv of
# `make test-compat`.
EXTRAS=${EXTRAS:-dev}
PIN=${PIN:-}
# One stamp per set of extras: `make run` (dev) never stands in for `make test` (dev,peers).
STAMP="$VENV/.varbench-installed-${EXTRAS//,/-}${PIN:+-pinned}"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    exit 0
fi
# OFFLINE: 1 = no package registry: the venv sees the system python's packages (its torch,
# transformers, ...) and installs nothing from an index, only wheels from WHEELHOUSE (a folder,
# optional); 0 = online; auto (default) = offline when $PY already has torch and a quick probe
# of the configured registry fails.
OFFLINE=${VARBENCH_OFFLINE:-auto}
WHEELHOUSE=${WHEELHOUSE:-}
case "$OFFLINE" in
    0|1|auto) ;;
    *) echo "scripts/setup.sh: error: VARBENCH_OFFLINE=$OFFLINE; choose 0, 1 or auto" >&2; exit 2 ;;
esac
if [ -n "$WHEELHOUSE" ] && [ ! -d "$WHEELHOUSE" ]; then
    echo "scripts/setup.sh: error: WHEELHOUSE=$WHEELHOUSE is not a folder" >&2
    exit 2
fi
SYSTEM_TORCH=0
if "$PY" -c "import torch" >/dev/null 2>&1; then
    SYSTEM_TORCH=1
fi
registry_reachable() {
    # One small download through pip's own configuration (index, proxies, certificates), no
    # retries: a registry that does not answer in 10 s is taken as absent.
    local d rc
    d=$(mktemp -d)
    "$PY" -m pip download --quiet --no-deps --no-cache-dir --timeout 10 --retries 0 \
        -d "$d" "setuptools>=68" >/dev/null 2>&1
    rc=$?
    rm -rf "$d"
    return $rc
}
if [ "$OFFLINE" = auto ]; then
    OFFLINE=0
    # Only a new venv is decided here (an existing one keeps how it was made); without pip in
    # $PY the probe cannot tell, and the online path stays the default.
    if [ "$SYSTEM_TORCH" = 1 ] && [ ! -x "$VENV/bin/python" ] \
            && "$PY" -m pip --version >/dev/null 2>&1 && ! registry_reachable; then
        OFFLINE=1
        echo "scripts/setup.sh: no package registry answered; reusing the packages installed" \
             "for $PY (VARBENCH_OFFLINE=0 forces the online install)"
    fi
fi
if [ "$OFFLINE" = 1 ]; then
    if [ "$SYSTEM_TORCH" != 1 ]; then
        echo "scripts/setup.sh: error: offline setup reuses an installed torch, and $PY has" \
             "none; set PYTHON to the python that holds torch" >&2
        exit 1
    fi
    # --without-pip: ensurepip would put its own pip and (Python <= 3.11) setuptools 65.5 into
    # the venv, ahead of the system's, and the build needs setuptools >= 68; the system's pip
    # installs into the venv all the same.
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages --without-pip "$VENV"
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        echo "scripts/setup.sh: error: $VENV cannot see the torch of $PY (made without" \
             "--system-site-packages?); remove $VENV and rerun" >&2
        exit 1
    fi
    if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        echo "scripts/setup.sh: error: offline setup installs with the pip of $PY, and $VENV" \
             "cannot run it (python -m pip); install pip for $PY" >&2
        exit 1
    fi
    # Every requirement of the chosen extras (and the build backend: nothing is fetched for an
    # isolated build) must be installed in an admitted version or come as a wheel from
    # WHEELHOUSE; name all that are not before pip stops at the first.
    if ! MISSING=$("$VENV/bin/python" scripts/requirements_missing.py "$EXTRAS" "$PIN"); then
        echo "scripts/setup.sh: error: could not read the requirements of pyproject.toml" >&2
        exit 1
    fi
    if [ -n "$MISSING" ] && [ -z "$WHEELHOUSE" ]; then
        echo "scripts/setup.sh: error: offline, and these requirements are neither installed" \
             "in an admitted version nor given as wheels (WHEELHOUSE=DIR):" >&2
        echo "$MISSING" | sed 's/^/    /' >&2
        exit 1
    fi
    PIP=("$VENV/bin/python" -m pip --quiet)
    OFF=(--no-index --no-build-isolation)
    [ -z "$WHEELHOUSE" ] || OFF+=(--find-links "$WHEELHOUSE")
    TARGET="."
    [ "$EXTRAS" = none ] || TARGET=".[$EXTRAS]"
    "${PIP[@]}" install "${OFF[@]}" -e "$TARGET" $PIN
    case ",$EXTRAS," in
        *,peers,*) "${PIP[@]}" install "${OFF[@]}" --no-deps "verl==0.9.1" ;;
    esac
    touch "$STAMP"
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
TARGET="."
[ "$EXTRAS" = none ] || TARGET=".[$EXTRAS]"
"${PIP[@]}" install -e "$TARGET" $PIN
case ",$EXTRAS," in
    *,peers,*) "${PIP[@]}" install --no-deps "verl==0.9.1" ;;  # deps: the peers extra
esac
touch "$STAMP"
