#!/usr/bin/env bash
# Issue 10's work on a GPU machine without network, in steps that each fit a 10-minute command.
# Run from the repository root, with the kit from scripts/gpu_kit.sh in .whl/:
#
#   bash benchmarks/gpu_session.sh STEP [STEP ...]
#
# Steps (benchmarks/GPU.md says which to batch into one command, and what each costs):
#   setup     install the kit (libaio, DeepSpeed and its needs) over the machine's own torch, and
#             build DeepSpeed's CPU Adam and async I/O ops (kept in .whl/ds_ops.tar.gz if present)
#   test      the not-slow test suite, CUDA tests included, 8 workers
#   test-all  every test, slow ones too
#   moves     bench_gpu_moves.py: page moves against a pinned copy_ and the link's bandwidth
#   fits      bench_engine.py, row fits, a GPT that fits: pagemem against plain PyTorch
#   offload   bench_offload.py: pagemem, DeepSpeed ZeRO-3 (cpu offload) and plain PyTorch, one GPT
#   lockfree  bench_lockfree.py --part throughput on the GPU: the lock-free updater against
#             states in cpu memory, the nvme tier capped (issue 22)
#   torchrun  pagemem train under torchrun on the GPU (world size 1: the NCCL-capable path, issue 32)
#   largest-cpu, largest-nvme
#             bench_offload.py --largest: the largest GPT each trains with that offload
#
# Logs and JSON results go to $OUT (the device tool's folder) or benchmarks/results/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
nvme_dir="${NVME_DIR:-/tmp/pagemem_nvme}"

install_kit() {
  [ -d /tmp/site ] && return 0
  for f in .whl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  ldconfig
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if [ -f .whl/ds_ops.tar.gz ]; then mkdir -p "$TORCH_EXTENSIONS_DIR" && tar -xzf .whl/ds_ops.tar.gz -C "$TORCH_EXTENSIONS_DIR"; fi
}

step() {  # step NAME COMMAND...: run it, its output to the console and $out/NAME.log
  local name=$1; shift
  echo "=== $name: $* ($(date +%T))"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc ($(date +%T))"
}

results() { cp benchmarks/results/*.json "$out"/ 2>/dev/null || true; }

for s in "$@"; do
  install_kit
  case "$s" in
    setup)
      step machine bash -c "nvidia-smi; $py -c 'import torch, deepspeed, pagemem; print(torch.__version__, torch.version.cuda, deepspeed.__version__, torch.cuda.get_device_name(0))'; nproc; free -g; df -h /tmp"
      step ds-ops $py -c "from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder; CPUAdamBuilder().load(); AsyncIOBuilder().load()"
      tar -czf "$out/ds_ops.tar.gz" -C "$TORCH_EXTENSIONS_DIR" . ;;
    test)
      step test $py -m pytest -q -m "not slow" -n 8 -p no:cacheprovider ;;
    test-all)
      step test-all $py -m pytest -q -n 8 -p no:cacheprovider ;;
    moves)
      step moves $py benchmarks/bench_gpu_moves.py --size 4GiB ;;
    fits)
      step fits $py benchmarks/bench_engine.py --rows fits --layers 12 --hidden 1024 --heads 16 --vocab 50304 \
        --batch 8 --seq 1024 --iters 10 ;;
    offload)
      step offload $py benchmarks/bench_offload.py --model gpt-1.3b --batch 8 --seq 1024 --offload cpu \
        --checkpoint-activations ;;
    lockfree)
      step lockfree $py benchmarks/bench_lockfree.py --part throughput --gpu_backend cuda ;;
    torchrun)
      step torchrun $py -m torch.distributed.run --standalone --nproc-per-node 1 -m pagemem train --train.steps 20 \
        --train.runs /tmp/pagemem-runs ;;
    largest-cpu)
      step largest-cpu $py benchmarks/bench_offload.py --largest --hidden 4096 --batch 4 --seq 1024 --offload cpu \
        --checkpoint-activations --systems pagemem,deepspeed --start-layers 16 --timeout 900 ;;
    largest-nvme)
      mkdir -p "$nvme_dir"
      step largest-nvme $py benchmarks/bench_offload.py --largest --hidden 4096 --batch 4 --seq 1024 --offload nvme \
        --nvme-path "$nvme_dir" --checkpoint-activations --systems pagemem,deepspeed --start-layers 16 --timeout 900 ;;
    *)
      echo "unknown step $s"; exit 2 ;;
  esac
  results
done
