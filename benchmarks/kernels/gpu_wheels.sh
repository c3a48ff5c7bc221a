#!/usr/bin/env bash
# Downloads into .whl/ the wheels that benchmarks.kernels.gpu_check (and the tests it runs, tests/gpu)
# needs on the GPU machine and that machine lacks: it has Python 3.12 with torch, triton,
# transformers, safetensors, numpy, msgpack, pyyaml, tqdm, prometheus-client, uvloop, httpx, pytest
# and psutil, and no internet.
#
# Of the engine's imports, only deployments (make_engine with mode="afd" or "colocated") need one
# more package: pyzmq (the ranks' control plane, and the data plane where shared memory is not
# used). fastapi, uvicorn and httptools serve HTTP only; gpu_check and tests/gpu do not import them.
#
#     benchmarks/kernels/gpu_wheels.sh          # here, with internet to PyPI: fills .whl/ (git-ignored)
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # there
#     PYTHONPATH=/tmp/site:. python3 -m benchmarks.kernels.gpu_check --json gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=(pyzmq==27.3.0)

rm -rf .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
ls -l .whl
