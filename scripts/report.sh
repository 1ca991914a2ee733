#!/usr/bin/env bash
# The main job: set up the environment, then run every optimizer on every installed backend, the ODE check,
# the golden fixtures and the memory table.  Plots go to out/ (report.png, report-ode.png) unless --plot is given;
# other options are passed on (adadiag-ref report --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
. .venv/bin/activate
plot=(--plot out/report.png)
for arg in "$@"; do
    case "$arg" in --plot | --plot=*) plot=() ;; esac
done
if [ ${#plot[@]} -gt 0 ]; then mkdir -p out; fi
adadiag-ref report "${plot[@]}" "$@"
