#!/usr/bin/env bash
# Download the extra wheels of the GPU runs (.gpu/extra): vLLM's OpenAI server's two
# missing packages, py-spy, and those that LMCache 0.5.2 needs (Python 3.12, torch
# 2.11.0+cu130, vLLM 0.26.0 runtime from ../shared/gpu/make-runtime.sh) so that vLLM's
# LMCacheConnectorV1 imports and constructs with a local CPU + local disk backend.
# Everything else LMCache imports on that path is already in the image or in the
# runtime's DEPS (see docs/lmcache-on-h200.md).
#
#   bash scripts/gpu_extra_wheels.sh [DIR]     (default DIR: .gpu/extra)
#
# On the GPU machine, carry DIR and install with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
# (scripts/h200_runs.sh does this for .gpu/extra).
set -euo pipefail
DIR=$(realpath -m "${1:-.gpu/extra}")
mkdir -p "$DIR"
# vLLM's OpenAI server needs jmespath and model-hosting-container-standards (not in the
# runtime); py-spy (its wheel holds the binary: h200_runs.sh unpacks it) for PROFILE=
WHEELS="lmcache==0.5.2 aiofile==3.12.3 caio==0.12.10 jmespath==1.0.1
        model-hosting-container-standards==0.1.16 py-spy==0.4.3"
PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"
# no manylinux_2_34: caio then comes as its pure-Python wheel (py3-none-any), which
# needs no particular glibc; aiofile is only imported on this path, never used
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
         manylinux1_x86_64 linux_x86_64; do PLAT="$PLAT --platform $p"; done
for w in $WHEELS; do
  if ! python3 -m pip download -q --no-deps $PLAT -d "$DIR" "$w"; then
    echo "ERROR: could not download $w (cp312 manylinux x86_64) into $DIR" >&2
    exit 1
  fi
done
# every pinned wheel must be there, exactly once
for w in $WHEELS; do
  name=${w%%==*}; name=${name//-/_}; ver=${w##*==}  # wheel names use underscores
  n=$(ls "$DIR"/${name}-${ver}-*.whl 2>/dev/null | wc -l)
  if [ "$n" -ne 1 ]; then
    echo "ERROR: expected one ${name}-${ver}-*.whl in $DIR, found $n" >&2
    exit 1
  fi
  ls -l "$DIR"/${name}-${ver}-*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
done
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "total of all wheels in $DIR: $total bytes ($(( total / 1048576 )) MiB; a call carries at most 64 MiB)"
if [ "$total" -gt $(( 64 * 1048576 )) ]; then
  echo "WARNING: $DIR exceeds 64 MiB: split it over two directories carried in separate calls" >&2
fi
