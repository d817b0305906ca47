#!/usr/bin/env bash
# Gather, on a machine with network, what a GPU machine without network lacks to run pagemem's
# tests and GPU benchmarks: wheels (Python 3.12, x86-64) and the libaio packages, into .whl/
# (ignored by git). benchmarks/gpu_session.sh installs them there.
#
# Usage: scripts/gpu_kit.sh [DIR]   (default .whl)
#
# What the GPU image already has (torch, numpy, xxhash, aiofiles, nvidia-ml-py, pytest, hypothesis,
# transformers, ninja, psutil, py-cpuinfo, msgpack, einops, tqdm) is not fetched: two versions of
# one package stop the whole install there. Missing:
#   pagemem:   libaio (Python, pure; an sdist, built into a wheel here)
#   DeepSpeed: deepspeed itself (an sdist; built here with no ops: they build at run time with the
#              GPU machine's nvcc), hjson, pydantic and its needs
#   system:    libaio1 + libaio-dev (.deb; DeepSpeed's NVMe offload compiles against them)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
mkdir -p "$dir"
python="${PYTHON:-.venv/bin/python}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d "$dir" \
  hjson==3.1.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5

python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8 libaio==0.9.5
# DS_BUILD_OPS=0: a pure-Python wheel; its ops compile on first use where they run.
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$tmp"/*.tar.gz

(cd "$dir" && apt-get download libaio1 libaio-dev >/dev/null 2>&1) \
  || echo "gpu_kit: apt-get download libaio1 libaio-dev failed; DeepSpeed's NVMe offload will not build there"
ls -la "$dir"
du -sh "$dir"
