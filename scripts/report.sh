#!/usr/bin/env bash
# The main job: set up the environment, then run every optimizer on every installed backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
. .venv/bin/activate
adadiag-ref report "$@"
