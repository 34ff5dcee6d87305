#!/usr/bin/env bash
# Compile the GPU branches of csrc/ on a machine without a GPU, so syntax and type errors in them
# fail CI (`make check-gpu-build`, part of `make test`). Idempotent; writes only under build/gpu_check/.
#   1. csrc/het_backend.cpp with -DUSE_CUDA (g++ -fsyntax-only) against torch's own headers and the
#      CUDA toolkit's headers: the event / pool-stream / pinned-staging paths the CPU build leaves out.
#   2. csrc/kernels/chunk_gemm_binding.cpp (g++ -fsyntax-only) and csrc/kernels/chunk_gemm.cu (nvcc -c).
#   3. chunk_gemm.cu for AMD with hipcc (hipified with the same name mapping as hipify-perl), when
#      Debian's hipcc can be found or installed; otherwise "skipped: no hipcc" and the check goes on.
# A missing nvcc or CUDA headers fails (the project's machines have them): set
# MEGATRON_HET_NO_CUDA_CHECK=1 only on a machine kind without a CUDA toolkit. MEGATRON_HET_NO_HIP_INSTALL=1
# keeps the script from installing hipcc with apt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=build/gpu_check
mkdir -p "$OUT"
start=$(date +%s)
say() { echo "check-gpu-build: $*"; }
fail() { say "FAILED: $*" >&2; exit 1; }
failed=()  # compile errors: every step still runs, so one CI log shows all of them

# --- torch's include dirs and the flags torch.utils.cpp_extension compiles extensions with -------
read -r TORCH_INC TORCH_API_INC PY_INC ABI < <("$PY" - <<'PY'
import sysconfig, torch
from torch.utils import cpp_extension
inc = cpp_extension.include_paths()  # [torch/include, torch/include/torch/csrc/api/include]
print(inc[0], inc[1], sysconfig.get_paths()["include"], int(torch._C._GLIBCXX_USE_CXX11_ABI))
PY
)
CXX=${CXX:-c++}
command -v "$CXX" >/dev/null || fail "no C++ compiler ($CXX)"
CXXFLAGS=(-std=c++20 -fsyntax-only -fPIC -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DTORCH_API_INCLUDE_EXTENSION_H
          -DTORCH_EXTENSION_NAME=het_gpu_check -Wall -Wno-unused-function -Wno-attributes)

# torch's CPU wheel ships c10/cuda headers but not the one CMake generates; a CUDA wheel has it.
STANDIN="$OUT/include/c10/cuda/impl/cuda_cmake_macros.h"
if [ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$(dirname "$STANDIN")"
  printf '#pragma once\n// Stand-in for the header a CUDA build of torch generates (scripts/check_gpu_build.sh).\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STANDIN"
fi

# --- CUDA ---------------------------------------------------------------------------------------
NVCC=${NVCC:-$(command -v nvcc || true)}
for cand in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
  [ -n "$NVCC" ] || { [ -x "$cand" ] && NVCC=$cand; } || true
done
if [ -z "$NVCC" ]; then
  if [ "${MEGATRON_HET_NO_CUDA_CHECK:-0}" = 1 ]; then
    say "skipped CUDA: no nvcc (MEGATRON_HET_NO_CUDA_CHECK=1)"
  else
    fail "nvcc not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin). Fix: install the CUDA toolkit, or set MEGATRON_HET_NO_CUDA_CHECK=1 on a machine kind without one"
  fi
else
  # Ask nvcc where its headers are (nvcc may be a wrapper script outside the toolkit).
  CUDA_INC=$("$NVCC" --dryrun -c csrc/kernels/chunk_gemm.cu -o "$OUT/dryrun.o" 2>&1 \
             | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
  [ -f "$CUDA_INC/cuda_runtime.h" ] || fail "no cuda_runtime.h where $NVCC says its headers are ('$CUDA_INC')"
  INC=(-I"$OUT/include" -I"$TORCH_INC" -I"$TORCH_API_INC" -I"$PY_INC" -I"$CUDA_INC")
  # Both C++ files at once (each spends ~20 s of CPU parsing torch/extension.h); logs printed after.
  t=$(date +%s)
  pids=()
  for src in csrc/het_backend.cpp csrc/kernels/chunk_gemm_binding.cpp; do
    "$CXX" "${CXXFLAGS[@]}" -DUSE_CUDA "${INC[@]}" "$src" >"$OUT/$(basename "$src").log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    src=$([ "$i" = 0 ] && echo csrc/het_backend.cpp || echo csrc/kernels/chunk_gemm_binding.cpp)
    if wait "${pids[$i]}"; then
      say "ok: $src -DUSE_CUDA ($(( $(date +%s) - t )) s)"
      grep "warning" "$OUT/$(basename "$src").log" | grep -v "pybind11/" || true  # ours, not torch's
    else
      cat "$OUT/$(basename "$src").log" >&2
      failed+=("g++ -DUSE_CUDA $src")
    fi
  done
  t=$(date +%s)
  version=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  if "$NVCC" -c csrc/kernels/chunk_gemm.cu -o "$OUT/chunk_gemm.o"; then
    say "ok: nvcc $version csrc/kernels/chunk_gemm.cu ($(( $(date +%s) - t )) s)"
  else failed+=("nvcc $version csrc/kernels/chunk_gemm.cu"); fi
fi

# --- HIP (optional) -----------------------------------------------------------------------------
HIPCC=${HIPCC:-$(command -v hipcc || true)}
why="not installed, and MEGATRON_HET_NO_HIP_INSTALL=1, not root, or no apt-get"
if [ -z "$HIPCC" ] && [ "${MEGATRON_HET_NO_HIP_INSTALL:-0}" != 1 ] && [ "$(id -u)" = 0 ] \
   && command -v apt-get >/dev/null; then
  why="apt could not install it: see $OUT/apt.log"
  say "installing Debian's hipcc + libamdhip64-dev (once; ~80 MB)"
  export DEBIAN_FRONTEND=noninteractive
  apt_install() { apt-get install -y -qq --no-install-recommends hipcc libamdhip64-dev >"$OUT/apt.log" 2>&1; }
  apt_install || { apt-get update -qq >>"$OUT/apt.log" 2>&1 && apt_install; } || true
  HIPCC=$(command -v hipcc || true)
fi
if [ -z "$HIPCC" ]; then
  say "skipped: no hipcc ($why)"
else
  # hipify-perl's mapping for the names chunk_gemm.cu uses (runtime API only, by design).
  sed -e 's|#include <cuda_runtime.h>|#include <hip/hip_runtime.h>|' -e 's/\bcuda\([A-Z][A-Za-z]*\)/hip\1/g' \
    csrc/kernels/chunk_gemm.cu > "$OUT/chunk_gemm.hip"
  if grep -n '\bcuda[A-Z_]' "$OUT/chunk_gemm.hip"; then fail "CUDA names left after hipify in chunk_gemm.cu (above)"; fi
  t=$(date +%s)
  # gfx90a = MI200 (MI250X), gfx908 = MI100: the AMD parts Debian's ROCm 5.2 targets. HIP_PLATFORM=amd:
  # with nvcc on PATH, hipcc would otherwise pick the NVIDIA platform.
  if HIP_PLATFORM=amd "$HIPCC" -c -x hip --offload-arch=gfx90a --offload-arch=gfx908 "$OUT/chunk_gemm.hip" -o "$OUT/chunk_gemm_hip.o"; then
    say "ok: hipcc csrc/kernels/chunk_gemm.cu for gfx90a,gfx908 ($(( $(date +%s) - t )) s)"
  else failed+=("hipcc csrc/kernels/chunk_gemm.cu (hipified)"); fi
  say "not compiled for ROCm: csrc/het_backend.cpp (needs a ROCm torch's c10/hip headers; a CPU torch has none)"
fi
[ "${#failed[@]}" = 0 ] || fail "$(printf '%s; ' "${failed[@]}")($(( $(date +%s) - start )) s)"
say "done in $(( $(date +%s) - start )) s"
