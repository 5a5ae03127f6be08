#!/usr/bin/env bash
# Try fsdp-shim from a clone, with nothing but Python 3.9+: a throwaway environment (.venv-try) with
# CPU torch installed first and pinned, Lightning 2.4.0 (affected), and this checkout; then
# `fsdp-shim verify`, which trains a model with the shim off and on and prints what changes.
#
#   bash scripts/try-it.sh                  # arguments go to `fsdp-shim verify`, e.g. --devices 2
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/try-it.sh
#
# TORCH_INDEX_URL picks where torch comes from: PyPI's torch for Linux is a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LIGHTNING_VERSION=${LIGHTNING_VERSION:-2.4.0}

python3 -m venv .venv-try
pip() { .venv-try/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "try-it: installing torch==$TORCH_VERSION (first, pinned), lightning==$LIGHTNING_VERSION and fsdp-shim into .venv-try" >&2
pip install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -r .ci/requirements-lightning.txt
pip install --no-deps "lightning==$LIGHTNING_VERSION"
pip install .
exec .venv-try/bin/fsdp-shim verify "$@"
