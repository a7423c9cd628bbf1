#!/usr/bin/env bash
# Launch a distcache training job with torchrun on this node.
#
# Usage:
#   launch/torchrun.sh [--section.key=value ...]
#   NPROC=4 CONFIG=configs/criteo_kaggle.toml launch/torchrun.sh --train.steps=1000
#
# Environment:
#   NPROC         processes (ranks) on this node            default 2
#   CONFIG        job config (TOML)                          default configs/tiny_cpu.toml
#   NNODES        nodes; > 1 needs RDZV_ENDPOINT=host:port   default 1 (standalone)
#   MAX_RESTARTS  torchrun restarts of a failed worker group default 0
#   PYTHON        interpreter                                default .venv/bin/python if present
# Extra arguments are config overrides (--section.key=value), --resume[=require|never] or
# --debug (tracebacks, from the check, the ranks and torchrun).
set -euo pipefail
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # this header
  sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"
  echo "The job's arguments and config keys: python -m distcache train --help; configs/*.toml."
  exit 0
fi
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
CONFIG="${CONFIG:-configs/tiny_cpu.toml}"
NNODES="${NNODES:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ "$NNODES" == 1 ]]; then
  RDZV=(--standalone)
else
  RDZV=(--rdzv-backend=c10d "--rdzv-endpoint=${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for NNODES > 1}")
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torchrun (launch/torchrun.py): it first checks the arguments, config and inputs, before any
# worker starts, each mistake named on one line (--debug: with the traceback); a failed job
# ends with one line naming the failed ranks.
exec "$PYTHON" launch/torchrun.py "${RDZV[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --max-restarts="$MAX_RESTARTS" -m distcache train --config "$CONFIG" "$@"
