#!/usr/bin/env bash
# The GPU acceptance (issue 15), run on the `device` machine from the repository root; see
# scripts/device_wheels.sh for getting lmdb, simplejpeg, turbojpeg and DALI there. Results go to $OUT (or ./gpu-out).
#   bash scripts/gpu_checks.sh small       # install .whl/small (lmdb, simplejpeg, turbojpeg): enough for all but DALI
#   bash scripts/gpu_checks.sh install     # reassemble /tmp/dw/site.tar.xz.part-NN into /tmp/site (DALI and its needs,
#                                          # and .whl/small's wheels where carried with the last part),
#                                          # and /tmp/dw/numba.tar.xz (numba, for jpeg-bench) where it was carried
#   bash scripts/gpu_checks.sh tests       # the cuda-marked tests without DALI (junit XML in $OUT)
#   bash scripts/gpu_checks.sh dali-tests  # every dali-marked test, the cuda + dali ones included
#   bash scripts/gpu_checks.sh remote      # install .whl/remote (moto's S3 server, s3fs, boto3): bench_gpu's remote
#                                          # part and the moto-backed tests (else skipped); carry: [".whl/remote"] (30 MB)
#   bash scripts/gpu_checks.sh bench       # bench_gpu.py: H2D, stalls, storage="cuda", memory (about 5 minutes);
#                                          # BENCH_PARTS=h2d,stalls,gather,cifar,memory,lmdb,scaling,mixture,remote for a
#                                          # subset, BENCH_RUNS=3 (issue 40), BENCH_ARGS="--no-plain", BENCH_TAG=x for
#                                          # $OUT/bench_gpu-x.json
#   bash scripts/gpu_checks.sh dali-bench  # bench_dali.py: nvJPEG training crops, its stall, its memory
#                                          # (DALI_ARGS="--no-eval --feeds dali,dali_here,fastdata" for a subset)
#   bash scripts/gpu_checks.sh text-bench  # bench_text.py: token windows to the GPU (not run yet)
#   bash scripts/gpu_checks.sh stages      # `fastdata bench` on a GPU (its H2D and GPU-transform stages)
#   bash scripts/gpu_checks.sh verdicts    # bench_verdicts.py: `fastdata bench` names the bound stage of three
#                                          # pipelines built to be bound by decode, pageable copies, the model
#   bash scripts/gpu_checks.sh jpeg-bench  # bench_jpeg.py on the machine's cores (no GPU; issue 17's thread
#                                          # scaling on a machine that is not a 2-vCPU VM; about 5 minutes;
#                                          # with numba installed (.whl/n0), the compiled decode loop too)
# Each writes $OUT/<mode>.txt (and .json / .xml); benchmarks/gpu_results.py merges them into
# benchmarks/results/gpu-YYYY-MM-DD.json.
#
# Issue 40 (the second GPU round) in the issue's order, as few calls as the device time allows (15 minutes a
# session, the machine's start included; each call right after the one before: it goes back after 30 s idle):
#   first, here: `bash scripts/device_wheels.sh small remote` (.whl/small and .whl/remote; the full run also
#       makes DALI's parts, minutes)
#   call 1, carry [".whl/small", ".whl/remote"], timeout 560:   bash scripts/gpu_checks.sh round2-a
#       every cuda-marked test but DALI's (the break rewind, run_ahead, the faults test with CUDA), then
#       bench_gpu h2d + stalls + gather with 3 runs (steady-state and whole-iteration stalls, the DataLoader,
#       eager and run_ahead rows beside them); about 6 minutes
#   call 2, carry the same, timeout = status's budget_left_s - 45 (a timeout still brings $OUT back):
#       bash scripts/gpu_checks.sh round2-b
#       bench_gpu lmdb, scaling (1-16 threads), mixture, remote (cold, warm) with 3 runs, then the verdicts;
#       about 5 minutes
#   calls 3-5 (the next session, most likely): DALI as before (carry one .whl/pK each, `mkdir -p /tmp/dw &&
#       cp .whl/pK/* /tmp/dw/`), the last one then `bash scripts/gpu_checks.sh install &&
#       bash scripts/gpu_checks.sh dali-tests && DALI_ARGS="--feeds dali,dali_auto --no-eval --profile-steps 0
#       --hw-rounds 2 --memory-iters 1000" bash scripts/gpu_checks.sh dali-bench`
# What a session does not reach, the next one starts with.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/site  # the image's own environment may not be writable: carried packages go here
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
pytest_run() {  # name, marker expression, files...
    local name=$1 expr=$2; shift 2
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
    # a hung test costs 120 s, the run 300 s at most (SIGINT: the junit XML is still written)
    timeout -s INT -k 20 "${TESTS_TIMEOUT:-300}" $PY -m pytest -p no:cacheprovider -o timeout=120 -m "$expr" -rs -v \
        --junitxml="$OUT/$name.xml" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -25
}
case "${1:-}" in
small)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/small/*.whl \
        2>&1 | tail -3
    $PY -c "import lmdb, simplejpeg, turbojpeg, torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    ;;
install)
    mkdir -p "$SITE"
    if compgen -G ".whl/small/*.whl" > /dev/null; then  # carried with the last part: lmdb, simplejpeg, turbojpeg
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/small/*.whl 2>&1 | tail -3
    else
        echo "no .whl/small here: carry it with the last part (carry: [\".whl/small\", \".whl/pK\"]), or run 'small' first" >&2
    fi
    if [ -f /tmp/dw/numba.tar.xz ]; then
        xz -d < /tmp/dw/numba.tar.xz | tar -C "$SITE" -xf - && rm -f /tmp/dw/numba.tar.xz
        $PY -c "import numba; print('numba', numba.__version__)"
    fi
    if compgen -G "/tmp/dw/site.tar.xz.part-*" > /dev/null; then
        cat /tmp/dw/site.tar.xz.part-* | xz -d | tar -C "$SITE" -xf - && rm -f /tmp/dw/site.tar.xz.part-*
        $PY -c "import nvidia.dali, lmdb, simplejpeg, torch; print('dali', nvidia.dali.__version__, 'torch', torch.__version__,
torch.cuda.get_device_name())"
    fi
    ;;
tests)
    pytest_run cuda-tests "cuda and not dali" tests
    ;;
dali-tests)
    pytest_run dali-tests "dali" tests
    ;;
remote)
    mkdir -p "$SITE"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/remote/*.whl \
        2>&1 | tail -3
    $PY -c "import moto.server, s3fs, boto3, flask, cryptography, aiohttp, werkzeug
print('moto', moto.__version__, 's3fs', s3fs.__version__, 'aiohttp', aiohttp.__version__, 'werkzeug',
      werkzeug.__version__)"
    ;;
bench)
    timeout -s INT -k 20 "${BENCH_TIMEOUT:-420}" $PY benchmarks/bench_gpu.py --seconds "${SECONDS_PER_ROW:-6}" \
        --runs "${BENCH_RUNS:-1}" ${BENCH_PARTS:+--parts "$BENCH_PARTS"} ${BENCH_ARGS:-} --json "$OUT/bench_gpu${BENCH_TAG:+-$BENCH_TAG}.json" 2>&1 | grep -v "^USDT:" \
        | tee "$OUT/bench_gpu${BENCH_TAG:+-$BENCH_TAG}.txt"
    ;;
verdicts)  # `fastdata bench`'s verdict on pipelines bound by decode, pageable copies, the model (about 75 s)
    timeout 170 $PY benchmarks/bench_verdicts.py --seconds 16 --json "$OUT/bench_verdicts.json" 2>&1 \
        | tee "$OUT/bench_verdicts.txt"
    ;;
round2-a)  # each step runs whatever the one before did; the exit status says whether any failed
    rc=0
    bash "$0" small || rc=1
    bash "$0" remote || rc=1
    bash "$0" tests || rc=1
    BENCH_TAG=a BENCH_RUNS=3 BENCH_PARTS=h2d,stalls,gather bash "$0" bench || rc=1
    echo "round2-a: rc=$rc"; exit $rc
    ;;
round2-b)  # installs again (seconds): a machine that went back between the calls starts bare
    rc=0
    bash "$0" small || rc=1
    bash "$0" remote || rc=1
    BENCH_TAG=b BENCH_RUNS=3 BENCH_PARTS=lmdb,scaling,mixture,remote bash "$0" bench || rc=1
    bash "$0" verdicts || rc=1
    echo "round2-b: rc=$rc"; exit $rc
    ;;
dali-bench)
    $PY benchmarks/bench_dali.py --images 2048 --seconds 5 --train-seconds "${SECONDS_PER_ROW:-6}" ${DALI_ARGS:-} \
        --json "$OUT/bench_dali.json" 2>&1 | grep -v "Profiler clears\|_warn_once" | tee "$OUT/bench_dali.txt"
    ;;
text-bench)
    $PY benchmarks/bench_text.py --mb 100 --batch 512 --seconds 3 2>&1 | tee "$OUT/bench_text.txt"
    ;;
stages)
    D=/tmp/fastdata-stages
    $PY -c "from fastdata.cli.synthetic import make_image_folder as m; m('$D/jpeg', num_classes=8, per_class=256)"
    $PY -m fastdata preprocess images "$D/jpeg" "$D/npy" --size 256 --quiet
    $PY -m fastdata bench "$D/npy" --device ${BENCH_DEVICE:-cuda} --seconds ${BENCH_SECONDS:-60} ${BENCH_ARGS:-} --json "$OUT/fastdata-bench.json" 2>&1 \
        | tee "$OUT/fastdata-bench.txt"
    ;;
jpeg-bench)
    $PY benchmarks/bench_jpeg.py --images 2048 --seconds 2 --rounds 1 --threads "${JPEG_THREADS:-1,2,4,8}" 2>&1 \
        | tee "$OUT/bench_jpeg.txt"
    ;;
*)
    echo "usage: $0 small|install|remote|tests|dali-tests|bench|dali-bench|text-bench|stages|jpeg-bench|verdicts|round2-a|round2-b" >&2
    exit 2 ;;
esac
