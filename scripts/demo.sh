#!/usr/bin/env bash
# Set up (idempotent) and run the main job: `fastdata demo` (extra arguments go to it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fastdata demo "$@"
