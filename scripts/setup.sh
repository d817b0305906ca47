#!/usr/bin/env bash
# Create the virtual environment pagemem runs in, installing what is missing.
# Usage: scripts/setup.sh [VENV_DIR]   (default .venv). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python="${PYTHON:-python3}"

# System packages: the kernel AIO library the libaio engine needs, and fio for the disk benchmark.
have_libaio() { ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1'; }
if ! have_libaio || ! command -v fio >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    pkgs="fio"
    if apt-cache show libaio1t64 >/dev/null 2>&1; then pkgs="$pkgs libaio1t64"; else pkgs="$pkgs libaio1"; fi
    echo "setup: installing system packages: $pkgs"
    $sudo apt-get install -y --no-install-recommends $pkgs >/dev/null 2>&1 \
      || { $sudo apt-get update >/dev/null 2>&1 && $sudo apt-get install -y --no-install-recommends $pkgs >/dev/null 2>&1; } \
      || echo "setup: could not install $pkgs; pagemem falls back to its thread-pool I/O engine"
  else
    echo "setup: no apt-get here; install libaio and fio yourself for the AIO engine and the disk benchmark"
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    echo "setup: this Python already has torch; the venv will use it"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi

pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  # Keep the torch that is there; constrain everything else.
  grep -v '^torch==' constraints.txt > "$venv/constraints-no-torch.txt"
  "${pip[@]}" -c "$venv/constraints-no-torch.txt" -e '.[test,hf,lightning,plot]' \
    || "${pip[@]}" --no-deps --no-build-isolation -e .
else
  "${pip[@]}" -c constraints.txt -e '.[test,hf,lightning,plot]'
fi
touch "$venv/.installed"
