#!/usr/bin/env bash
# The device check, in one call on a lent GPU machine (see the README's CUDA section):
# the CUDA tests (tests marked `cuda` and every pinned-slot test) and `python -m bench.gpu`.
# Where the machine's Python lacks posix_ipc, wheels in .whl/ are installed first; where the
# compiled module is missing for its Python, it is built in place.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
python3 -c "import shmloader._ring" 2>/dev/null || python3 setup.py -q build_ext --inplace
python3 -c "import shmloader; print('shmloader', shmloader.__version__)" || exit 1
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -ra -p no:cacheprovider \
    tests/test_cuda.py tests/test_cuda_integrations.py tests/test_layout.py tests/test_loader_equality.py \
    -k "cuda or pin" 2>&1 \
    | tee "$OUT/pytest.log" | tail -25
[ -n "${TESTS_ONLY:-}" ] && exit 0
timeout 120 python3 -m tools.gpu_probes 2>&1 | tee "$OUT/probes.log"
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout "${BENCH_SECONDS:-240}" python3 -m bench.gpu --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-gpu.log"
# compute sized well above what the workers need per batch, so that the step shows whether the
# copy hides behind compute (at ratio 1 the four workers, not the copy, set the pace)
timeout "${BENCH_SECONDS:-240}" python3 -m bench.gpu --out "$OUT" --compute-ratio 8 --workers 8 2>&1 | tee "$OUT/bench-gpu-ratio8.log"
