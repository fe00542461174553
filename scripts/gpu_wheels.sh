#!/bin/sh
# The wheels of requirements-gpu.txt for a GPU machine with no network (make test-gpu there):
# Python 3.12, Linux x86-64 (manylinux), one version of each, no dependency resolved (the list
# names every one). Run it where pip can reach PyPI:
#
#     sh scripts/gpu_wheels.sh WHEELS        # about 30 MB; PYTHON=python3.12 to choose pip's Python
#
# then carry WHEELS to the GPU machine and install from it there:
#
#     python3 -m pip install --no-index --no-deps WHEELS/*.whl
#     (or --target /tmp/site WHEELS/*.whl, and export PYTHONPATH=/tmp/site)
set -eu
dir=${1:?usage: sh scripts/gpu_wheels.sh FOLDER}
here=$(cd "$(dirname "$0")/.." && pwd)
requirements="$here/requirements-gpu.txt"
# llguidance's wheel is tagged manylinux_2_31; pip matches each tag exactly, so all are named.
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" -r "$requirements"
wanted=$(grep -c '==' "$requirements")
have=$(ls "$dir"/*.whl | wc -l)
size=$(du -ck "$dir"/*.whl | tail -1 | cut -f1)
echo "$have wheels in $dir ($((size / 1024)) MB) for the $wanted packages of requirements-gpu.txt"
if [ "$have" -ne "$wanted" ]; then
    echo "expected exactly one wheel per package: empty $dir and run this again" >&2
    exit 1
fi
