#!/usr/bin/env bash
# Prepare the wheels the GPU checks need on a machine with no package registry (the `device` machine:
# Python 3.12, torch with CUDA 13, no DALI, no lmdb; simplejpeg and turbojpeg for the CPU JPEG path),
# in parts small enough for one transfer each.
#   bash scripts/device_wheels.sh            -> .whl/p0 .whl/p1 ... (each under 56 MiB; .whl/ is git-ignored)
# Carry one part per call (`carry: [".whl/pK"]`, command `mkdir -p /tmp/dw && cp .whl/pK/* /tmp/dw/`),
# then run `bash scripts/gpu_checks.sh install` there; see scripts/gpu_checks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_VERSION:-3.12}
DALI=${DALI_WHEEL:-nvidia-dali-cuda130==2.4.0}
PART=$((56 << 20))  # with the working tree, under the 64 MiB one call carries
rm -rf .whl && mkdir -p .whl/all
.venv/bin/python -m pip download --quiet --only-binary=:all: --python-version "$PY" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl/all "$DALI" lmdb simplejpeg turbojpeg 2>&1 | grep -v "is ignored" || true
rm -f .whl/all/numpy-*.whl  # the device image has numpy; a second one would replace it
k=0; size=0; mkdir -p .whl/p0
for f in $(ls -S .whl/all/*.whl); do
    n=$(stat -c %s "$f")
    if [ "$n" -gt "$PART" ]; then  # too big for one transfer: cut it into pieces of its own
        split -b "$PART" -d -a 2 "$f" "$f.part-"
        for piece in "$f".part-*; do
            k=$((k + 1)); mkdir -p ".whl/p$k"; size=$(stat -c %s "$piece"); mv "$piece" ".whl/p$k/"
        done
        continue  # smaller wheels may join the last piece's part
    fi
    if [ $((size + n)) -gt "$PART" ]; then k=$((k + 1)); mkdir -p ".whl/p$k"; size=0; fi
    cp "$f" ".whl/p$k/"; size=$((size + n))
done
rm -rf .whl/all
find .whl -type d -empty -delete
du -sh .whl/p*
