#!/usr/bin/env bash
# The GPU checks of issues 5 and 8, run on the `device` machine from the repository root (see
# scripts/device_wheels.sh for getting DALI and lmdb there). Results go to $OUT (or ./gpu-out).
#   bash scripts/gpu_checks.sh install   # reassemble /tmp/dw/*.part-NN, install DALI + lmdb + fastdata
#   bash scripts/gpu_checks.sh tests     # pytest -m cuda (cuda+dali included), then the DALI CPU tests there
#   bash scripts/gpu_checks.sh bench     # bench_gpu.py, bench_dali.py, bench_text.py (about 7 minutes)
#   bash scripts/gpu_checks.sh stages    # `fastdata bench` on a GPU (its H2D and GPU-transform stages)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/site  # the image's own environment may not be writable: carried packages go here
export PYTHONPATH=$SITE:$PWD
case "${1:-}" in
install)
    cd /tmp/dw
    for first in *.part-00; do
        [ -e "$first" ] || continue
        whl=${first%.part-00}; cat "$whl".part-* > "$whl" && rm -f "$whl".part-*
    done
    cd - >/dev/null
    # The image already has these (device README): a second copy on the path would shadow its own.
    wheels=$(ls /tmp/dw/*.whl | grep -Eiv '/(numpy|packaging|pyyaml|six|typing_extensions|wheel)-')
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels \
        2>&1 | tail -3
    $PY -c "import nvidia.dali, lmdb, simplejpeg, torch; print('dali', nvidia.dali.__version__, 'torch', torch.__version__,
torch.cuda.get_device_name())"
    ;;
tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    $PY -m pytest -p no:cacheprovider -m "cuda" -rs -v tests 2>&1 | tee "$OUT/cuda-tests.txt" | tail -40
    $PY -m pytest -p no:cacheprovider -x -q -m "not slow" tests/test_prefetch.py tests/test_gpu_transforms.py \
        tests/test_dali.py 2>&1 | tail -5 | tee -a "$OUT/cuda-tests.txt"
    ;;
bench)
    $PY benchmarks/bench_gpu.py --seconds "${SECONDS_PER_ROW:-10}" 2>&1 | tee "$OUT/bench_gpu.txt"
    $PY benchmarks/bench_dali.py --images 2048 --seconds 5 --train-seconds "${SECONDS_PER_ROW:-10}" 2>&1 \
        | tee "$OUT/bench_dali.txt"
    $PY benchmarks/bench_text.py --mb 100 --batch 512 --seconds 3 2>&1 | tee "$OUT/bench_text.txt"
    ;;
stages)
    D=/tmp/fastdata-stages
    $PY -c "from fastdata.synthetic import make_image_folder as m; m('$D/jpeg', num_classes=8, per_class=256)"
    $PY -m fastdata preprocess images "$D/jpeg" "$D/npy" --size 256 --quiet
    $PY -m fastdata bench "$D/npy" --device ${BENCH_DEVICE:-cuda} --seconds ${BENCH_SECONDS:-60} ${BENCH_ARGS:-} --json "$OUT/fastdata-bench.json" 2>&1 \
        | tee "$OUT/fastdata-bench.txt"
    ;;
*)
    echo "usage: $0 install|tests|bench|stages" >&2; exit 2 ;;
esac
