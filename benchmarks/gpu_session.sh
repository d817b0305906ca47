#!/usr/bin/env bash
# Issue 36's work on a GPU machine without network, as steps run in order of value under one
# deadline, each figure packed for return as soon as its step ends. From the repository root,
# with the kit from scripts/gpu_kit.sh in .whl/:
#
#   GPU_DEADLINE_S=420 bash benchmarks/gpu_session.sh STEP [STEP ...]
#
# Steps (benchmarks/GPU.md says which to batch, and what each costs):
#   setup       install the kit (libaio, DeepSpeed and its needs) over the machine's own torch; the
#               versions, the GPU, the PCIe link, host memory and disk; DeepSpeed's CPU Adam and
#               async I/O ops start building in the background (offload and largest wait for them;
#               returned as ds_ops.tar.gz: put it in .whl/ and later runs skip the build)
#   cuda-tests  the CUDA tests (pytest -m cuda), every traceback kept
#   test        the not-slow suite, 8 workers;   test-all: every test
#   moves       bench_gpu_moves.py: page moves against a pinned copy_ and the link's bandwidth
#   fits        bench_engine.py, row fits, a GPT that fits: pagemem against plain PyTorch
#   offload     bench_offload.py: plain PyTorch, pagemem (cpu offload), DeepSpeed ZeRO-3 (cpu offload)
#   probe       gpu_probe.py: bench_offload's pagemem row iteration by iteration (modes, where a plan
#               was left, phase times, a profile); probe-plain: the same without checkpointing
#   lockfree    bench_lockfree.py --part throughput on the GPU (issue 22)
#   torchrun    pagemem train under torchrun on the GPU, one rank (issue 32)
#   largest-cpu, largest-nvme
#               bench_offload.py --largest: the largest GPT each system trains with that offload
#
# GPU_DEADLINE_S (seconds from the start, default 3000): a step runs under `timeout` with what is
# left less GPU_RESERVE_S (default 25), and is skipped with under 30 s left. Logs and JSON go to
# GPU_WORK (default /tmp/gpu_work), packed after every step into $OUT/gpu.tar.gz, with
# $OUT/summary.txt (each step's exit and time, and every line a benchmark marks as a goal).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
deadline=$((start + ${GPU_DEADLINE_S:-3000}))
reserve=${GPU_RESERVE_S:-25}
work="${GPU_WORK:-/tmp/gpu_work}"
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$work" "$out"
marker="$work/.start"; touch "$marker"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TORCH_EXTENSIONS_DIR=/tmp/torch_extensions MAX_JOBS=12 \
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # DeepSpeed's builder cannot parse torch's '9.0a'
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PY:-python3}"
nvme_dir="${NVME_DIR:-/tmp/pagemem_nvme}"

say() { echo "$*" | tee -a "$work/summary.txt"; }

pack() {  # the logs, the results written since the start, the summary: into $out
  find benchmarks/results -maxdepth 1 -name '*.json' -newer "$marker" -exec cp {} "$work"/ \; 2>/dev/null
  tar -czf "$out/gpu.tar.gz.tmp" -C "$work" --exclude=.start . && mv "$out/gpu.tar.gz.tmp" "$out/gpu.tar.gz"
  cp "$work/summary.txt" "$out/summary.txt" 2>/dev/null || true
}

install_kit() {
  [ -d /tmp/site ] && return 0
  for f in .whl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  ldconfig
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if [ -f .whl/ds_ops.tar.gz ]; then mkdir -p "$TORCH_EXTENSIONS_DIR" && tar -xzf .whl/ds_ops.tar.gz -C "$TORCH_EXTENSIONS_DIR"; fi
}

ds_build_start() {  # DeepSpeed's ops, compiled in the background while the tests run
  [ -n "${ds_pid:-}" ] && return 0
  nice -n 10 $py -c "
import time; t = time.time()
from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder
CPUAdamBuilder().load(); print('cpu_adam built', round(time.time() - t), 's', flush=True)
AsyncIOBuilder().load(); print('async_io built', round(time.time() - t), 's', flush=True)
" > "$work/ds-ops.log" 2>&1 &
  ds_pid=$!
}

ds_build_wait() {
  [ -z "${ds_pid:-}" ] && ds_build_start
  local left=$((deadline - $(date +%s) - reserve))
  local waited=0
  while kill -0 "$ds_pid" 2>/dev/null && [ $waited -lt $left ]; do sleep 2; waited=$((waited + 2)); done
  say "--- ds-ops: $(tail -n 2 "$work/ds-ops.log" | tr '\n' ' ')"
  tar -czf "$out/ds_ops.tar.gz" -C "$TORCH_EXTENSIONS_DIR" . 2>/dev/null || true
}

step() {  # step NAME COMMAND...: under the deadline, to the console and $work/NAME.log
  local name=$1; shift
  local left=$((deadline - $(date +%s) - reserve))
  if [ $left -lt 30 ]; then say "=== $name: skipped, ${left} s left"; return; fi
  local t0=$(date +%s)
  echo "=== $name: $* ($(date +%T), up to ${left} s)"
  timeout -k 10 --signal=INT "$left" "$@" 2>&1 | tee "$work/$name.log"
  local rc=${PIPESTATUS[0]}
  say "=== $name: exit $rc in $(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] && echo ' (deadline)')"
  grep -hiE "^goal|goal .*(met|NOT)|passed|failed|error" "$work/$name.log" | tail -n 25 | sed 's/^/    /' >> "$work/summary.txt"
  pack
}

for s in "$@"; do
  install_kit
  case "$s" in
    setup)
      step machine bash -c "nvidia-smi; nvidia-smi -q | grep -iA12 'PCI$\|GPU Link Info' | head -40; $py -c 'import torch, deepspeed, pagemem; print(torch.__version__, torch.version.cuda, deepspeed.__version__, torch.cuda.get_device_name(0))'; nproc; free -g; df -h /tmp; uname -r"
      ds_build_start ;;
    cuda-tests)
      step cuda-tests $py -m pytest -q -m cuda -n 4 --dist loadfile -p no:cacheprovider -rfE --tb=long tests/ ;;
    test)
      step test $py -m pytest -q -m "not slow" -n 8 -p no:cacheprovider -rfE ;;
    test-all)
      step test-all $py -m pytest -q -n 8 -p no:cacheprovider -rfE ;;
    moves)
      step moves $py benchmarks/bench_gpu_moves.py --size 4GiB ;;
    fits)
      step fits $py benchmarks/bench_engine.py --rows fits --layers 12 --hidden 1024 --heads 16 --vocab 50304 \
        --batch 8 --seq 1024 --warmup 2 --iters 6 ;;
    offload)
      ds_build_wait
      step offload $py benchmarks/bench_offload.py --model gpt-1.3b --batch 8 --seq 1024 --offload cpu \
        --checkpoint-activations --warmup 2 --iters 4 --timeout 240 ;;
    probe)
      step probe $py benchmarks/gpu_probe.py --model gpt-1.3b --batch 8 --seq 1024 --offload cpu \
        --checkpoint-activations --iters 4 --profile ;;
    probe-plain)
      step probe-plain $py benchmarks/gpu_probe.py --model gpt-1.3b --batch 4 --seq 1024 --offload cpu --iters 4 ;;
    lockfree)
      step lockfree $py benchmarks/bench_lockfree.py --part throughput --gpu_backend cuda ;;
    torchrun)
      step torchrun $py -m torch.distributed.run --standalone --nproc-per-node 1 -m pagemem train --train.steps 20 \
        --train.runs /tmp/pagemem-runs ;;
    largest-cpu)
      ds_build_wait
      step largest-cpu $py benchmarks/bench_offload.py --largest --hidden 4096 --batch 4 --seq 1024 --offload cpu \
        --checkpoint-activations --systems pagemem,deepspeed --start-layers 16 --max-layers 64 --timeout 900 ;;
    largest-nvme)
      ds_build_wait
      mkdir -p "$nvme_dir"
      step largest-nvme $py benchmarks/bench_offload.py --largest --hidden 4096 --batch 4 --seq 1024 --offload nvme \
        --nvme-path "$nvme_dir" --checkpoint-activations --systems pagemem,deepspeed --start-layers 16 --max-layers 64 --timeout 900 ;;
    *)
      echo "unknown step $s"; exit 2 ;;
  esac
done
[ -n "${ds_pid:-}" ] && ! kill -0 "$ds_pid" 2>/dev/null && tar -czf "$out/ds_ops.tar.gz" -C "$TORCH_EXTENSIONS_DIR" . 2>/dev/null
say "=== done in $(( $(date +%s) - start )) s"
pack
