#!/usr/bin/env bash
# Prepare the packages the GPU checks need on a machine with no package registry (the `device` machine:
# Python 3.12, torch with CUDA 13, no DALI, no lmdb), in parts small enough for one transfer each:
#   .whl/small    the wheels the CPU JPEG path and the LMDB format need (lmdb, simplejpeg, turbojpeg): 1.5 MB
#   .whl/p0 ...   DALI and its needs, unpacked here into one site folder (other Pythons' extension modules
#                 dropped) and sent as an xz tarball cut into pieces: 280 MB of wheels become 3 parts of 61 MiB
#   .whl/n0       numba and llvmlite, the same way, in a tarball of their own (one part): only jpeg-bench
#                 needs them (the compiled decode loop, NOTE [nogil loop]), so they cost no DALI call a part
#   .whl/remote   wheels for bench_gpu.py's `remote` part and the moto-backed tests: moto's S3 server (flask),
#                 s3fs, aiobotocore, boto3 and what they need that the device image lacks (it has numpy, fsspec,
#                 aiohttp, werkzeug, pyyaml, six, pytest): 30 MB (botocore 16), pinned to this checkout's .venv versions
#   bash scripts/device_wheels.sh          # everything
#   bash scripts/device_wheels.sh small remote   # those bundles alone (the rest of .whl kept)
# Carry `.whl/small` and one part per call (`carry: [".whl/small", ".whl/pK"]`, command
# `mkdir -p /tmp/dw && cp .whl/pK/* /tmp/dw/`), one call right after the other (the machine goes back after
# 30 s idle, and /tmp with it); then `bash scripts/gpu_checks.sh install` there (see scripts/gpu_checks.sh).
# `.whl/n0` is carried the same way, before `install`, when jpeg-bench is to run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_VERSION:-3.12}
DALI=${DALI_WHEEL:-nvidia-dali-cuda130==2.4.0}
PART=${PART_BYTES:-$((61 << 20))}  # with the working tree, under the 64 MiB one call carries
TAG=cpython-${PY/./}
get() {  # wheels for the device's Python and platform
    .venv/bin/python -m pip download --quiet --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "$@" 2>&1 | grep -v "is ignored" || true
}
# moto's S3 server, s3fs and boto3, less what the device image has; fsspec rides along because s3fs wants its
# own release of it (the image's may be another), jinja2 because moto's responses need it
REMOTE="moto flask flask-cors blinker click itsdangerous jinja2 boto3 botocore s3transfer jmespath python-dateutil
urllib3 xmltodict responses requests certifi charset-normalizer cryptography cffi pycparser s3fs fsspec aiobotocore
aioitertools wrapt"
remote() {  # .whl/remote: each package at the version this checkout's .venv runs (they are known to work together)
    local freeze pins=() name
    freeze=$(.venv/bin/python -m pip freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
    for name in $REMOTE; do
        pins+=("$(grep -m1 "^$name==" <<< "$freeze" || echo "$name")")
    done
    rm -rf .whl/remote && mkdir -p .whl/remote
    get --no-deps -d .whl/remote "${pins[@]}"
    du -sh .whl/remote
}
small() {  # .whl/small: what the CPU JPEG path and the LMDB format need
    rm -rf .whl/small && mkdir -p .whl/small
    get --no-deps -d .whl/small lmdb simplejpeg turbojpeg
    du -sh .whl/small
}
if [ $# -gt 0 ]; then  # some bundles alone, the rest of .whl kept: `small`, `remote`
    for what in "$@"; do
        case $what in
        small) small ;;
        remote) remote ;;
        *) echo "usage: $0 [small] [remote]  (no argument: every bundle)" >&2; exit 2 ;;
        esac
    done
    exit 0
fi
rm -rf .whl && mkdir -p .whl/all .whl/numba .whl/n0
remote
small
get -d .whl/all "$DALI"
get --no-deps -d .whl/numba numba llvmlite  # the compiled JPEG decode loop, for jpeg-bench
for w in .whl/numba/*.whl; do unzip -q -o "$w" -d .whl/numba/site; done
rm -rf .whl/numba/site/*.data
tar -C .whl/numba/site -cf - . | xz -9 -T0 > .whl/n0/numba.tar.xz
rm -rf .whl/numba
# The device image has these already: a second copy on the path would shadow its own.
rm -f .whl/all/{numpy,packaging,pyyaml,six,typing_extensions,wheel}-*.whl
site=.whl/site && mkdir -p "$site"
for w in .whl/all/*.whl; do unzip -q -o "$w" -d "$site"; done
rm -rf "$site"/*.data  # console scripts (tfrecord2idx): not needed
find "$site/nvidia/dali" -maxdepth 1 -name 'backend_impl.cpython-*.so' ! -name "backend_impl.$TAG-*" -delete
# nvidia/ is a namespace torch's CUDA wheels share on the device: extend it rather than shadow theirs
echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" > "$site/nvidia/__init__.py"
tar -C "$site" -cf - . | xz -9 -T0 > .whl/site.tar.xz
split -b "$PART" -d -a 2 .whl/site.tar.xz .whl/site.tar.xz.part-
k=0
for piece in .whl/site.tar.xz.part-*; do mkdir -p ".whl/p$k"; mv "$piece" ".whl/p$k/"; k=$((k + 1)); done
rm -rf .whl/all "$site" .whl/site.tar.xz
du -sh .whl/small .whl/p* .whl/n0 .whl/remote
