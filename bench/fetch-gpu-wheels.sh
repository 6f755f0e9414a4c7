#!/bin/bash
# Download, here, the cp312 wheels the GPU machine lacks into the git-ignored .whl/ (carried there by the device tool).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
for pkg in nixl==1.5.1 nixl-cu13==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 transitions==0.9.3 structlog==26.1.0 \
           opentelemetry-api==1.45.2 xxhash==4.1.0 attrs==26.1.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
           pygments==2.21.0 importlib-metadata==10.2.0 zipp==4.1.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls .whl
