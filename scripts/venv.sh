# Sourced from the repository root by scripts/run_debug.sh and scripts/test.sh:
#   . scripts/venv.sh EXTRAS        (e.g. "dev" or "report")
# Creates the virtual environment .venv (reused when present), installs torch and
# trainlib (editable, with EXTRAS) into it, and activates it. It needs only a
# Python >= 3.10 with its venv module (PYTHON=... picks one) and installs nothing
# outside .venv, so it also works where the system Python is externally managed
# (PEP 668).
#
# torch: one already in .venv is kept, so install your own build there first to
# choose it. Otherwise: with an NVIDIA GPU, PyPI's torch (a CUDA build on Linux);
# without one, a CPU build: from pip's configured sources when they already offer
# a +cpu wheel, else from PyTorch's CPU wheel index.
TORCH_VERSION=2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  if ! "${PYTHON:-python3}" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "trainlib needs Python >= 3.10 with its venv module; set PYTHON=/path/to/python3.X" >&2
    exit 2
  fi
  echo "creating the virtual environment .venv (the first install takes a few minutes)"
  if ! "${PYTHON:-python3}" -m venv --clear .venv >/dev/null; then
    echo "could not create .venv; on Debian/Ubuntu install the venv module: apt install python3-venv" >&2
    exit 2
  fi
fi
. .venv/bin/activate

if ! python -c 'import torch' 2>/dev/null; then
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "NVIDIA GPU found: installing torch $TORCH_VERSION from PyPI (a CUDA build); for another CUDA" \
         "version, install torch from pytorch.org into .venv first"
    python -m pip install -q "torch==$TORCH_VERSION"
  elif python -m pip index versions torch 2>/dev/null | tr -s ', ' '\n' | grep -xF "$TORCH_VERSION+cpu" >/dev/null; then
    # pip's sources list a compatible +cpu wheel (read from the indexes: no wheel is downloaded), and
    # "torch==$TORCH_VERSION" picks it: a local version label sorts above the plain version.
    python -m pip install -q "torch==$TORCH_VERSION"
  else
    echo "no NVIDIA GPU: installing the CPU build of torch $TORCH_VERSION from PyTorch's CPU wheel index"
    python -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# Editable: code changes need no reinstall, only a change of the dependencies does.
stamp=".venv/trainlib[$1].installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  python -m pip install -q -e ".[$1]"
  touch "$stamp"
fi
