#!/usr/bin/env bash
# Installs everything and runs the whole test suite (core and every plugin).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
# Lint and format first: a finding fails the run before the long tests start.
ruff check .
ruff format --check .
set +e
python -m pytest -ra "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "no tests ran"; exit 1; }
exit $rc
