#!/usr/bin/env bash
# specd's GPU check: install against the machine's own torch, then tools/gpu_check.py (its
# docstring says what it runs and measures). On a machine without network, what the machine
# lacks comes as wheels in the folder $SPECD_WHEELS (default: wheels/ in the checkout).
#
#   tools/gpu_check.sh --out "$OUT"    # on the GPU machine: one JSON in $OUT/gpu_check.json
#   tools/gpu_check.sh --dry-run       # here: every file, flag and model it uses exists
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${SPECD_WHEELS:-wheels}"

if [[ " $* " != *" --dry-run "* ]]; then
  # The machine's torch stays: specd asks torch>=2.11, and --no-deps keeps pip off the network.
  "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null \
    || echo "gpu_check: no editable install (old pip or setuptools); running from the checkout"
  missing=$("$PYTHON" - <<'PY'
import importlib.util
wanted = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
          "accelerate": "accelerate", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
          "grpc_reflection": "grpcio-reflection", "google.protobuf": "protobuf", "opentelemetry.sdk": "opentelemetry-sdk",
          "opentelemetry.exporter.otlp.proto.grpc": "opentelemetry-exporter-otlp-proto-grpc",
          "opentelemetry.instrumentation.grpc": "opentelemetry-instrumentation-grpc", "prometheus_client": "prometheus-client",
          "numpy": "numpy", "jinja2": "jinja2", "pytest": "pytest", "pytest_asyncio": "pytest-asyncio"}
def present(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(package for module, package in wanted.items() if not present(module)))
PY
)
  if [[ -n "$missing" ]]; then
    if [[ -d "$WHEELS" ]]; then
      "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
    else
      echo "gpu_check: this machine lacks $missing and there is no $WHEELS/ to install them from" >&2
      exit 1
    fi
  fi
fi
exec "$PYTHON" tools/gpu_check.py "$@"
