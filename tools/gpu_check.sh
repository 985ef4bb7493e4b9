#!/usr/bin/env bash
# specd's GPU check: install against the machine's own torch, then tools/gpu_check.py (its
# docstring says what it runs and measures). On a machine without network, what the machine
# lacks comes as wheels in the folder $SPECD_WHEELS (default: wheels/ in the checkout), which
# `tools/gpu_check.sh --wheels` (make gpu-wheels) downloads here for the GPU machine's Python.
#
#   tools/gpu_check.sh --wheels        # here, with network: wheels/ for Python 3.12 on x86_64 Linux
#   tools/gpu_check.sh --out "$OUT"    # on the GPU machine: one JSON in $OUT/gpu_check.json
#   tools/gpu_check.sh --dry-run       # here: every file, flag and model it uses exists
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${SPECD_WHEELS:-wheels}"
# module:package. The machine's torch stack (torch, transformers, tokenizers, safetensors, numpy)
# is its own; the rest are small wheels, fetched with their dependencies.
ML_STACK="torch:torch transformers:transformers tokenizers:tokenizers safetensors:safetensors numpy:numpy"
SERVING="grpc:grpcio grpc_health:grpcio-health-checking grpc_reflection:grpcio-reflection google.protobuf:protobuf<8
opentelemetry.sdk:opentelemetry-sdk opentelemetry.exporter.otlp.proto.grpc:opentelemetry-exporter-otlp-proto-grpc
opentelemetry.exporter.otlp.proto.http:opentelemetry-exporter-otlp-proto-http
opentelemetry.instrumentation.grpc:opentelemetry-instrumentation-grpc prometheus_client:prometheus-client
jinja2:jinja2 aiohttp:aiohttp pytest:pytest pytest_asyncio:pytest-asyncio"
# Needs torch, which the machine has: fetched without its dependencies.
NO_DEPS="accelerate:accelerate"

packages() { for pair in $1; do echo -n "${pair#*:} "; done; }

if [[ " $* " == *" --wheels "* ]]; then
  fetch=(-m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version 3.12
         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any)
  # shellcheck disable=SC2046 # one word per package
  "$PYTHON" "${fetch[@]}" $(packages "$SERVING")
  # shellcheck disable=SC2046
  "$PYTHON" "${fetch[@]}" --no-deps $(packages "$NO_DEPS")
  du -sh "$WHEELS"
  exit 0
fi

if [[ " $* " != *" --dry-run "* ]]; then
  # The machine's torch stays: specd asks torch>=2.11, and --no-deps keeps pip off the network.
  "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null \
    || echo "gpu_check: no editable install (old pip or setuptools); running from the checkout"
  missing=""
  for pair in $ML_STACK $SERVING $NO_DEPS; do
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pair%%:*}') is None)" 2>/dev/null \
      || missing+="${pair#*:} "
  done
  if [[ -n "$missing" ]]; then
    if [[ -d "$WHEELS" ]]; then
      # shellcheck disable=SC2086 # one word per package
      "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
    else
      echo "gpu_check: this machine lacks $missing and there is no $WHEELS/ to install them from" >&2
      exit 1
    fi
  fi
fi
exec "$PYTHON" tools/gpu_check.py "$@"
