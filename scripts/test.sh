#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
# On x86-64 Linux the DALI extra is installed too (its wheels exist only there), so the `dali` tests run
# on the CPU; elsewhere they are skipped. EXTRAS overrides the choice.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${EXTRAS:-}" ]; then
    if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then EXTRAS="test,dali,docs"; else EXTRAS="test,docs"; fi
fi
EXTRAS="$EXTRAS" bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
