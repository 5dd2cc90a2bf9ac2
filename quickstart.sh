#!/usr/bin/env bash
# Strata in one command: install, fetch the default model, profile this machine, plan, run a prompt.
set -euo pipefail
cd "$(dirname "$0")"
MODEL=${MODEL:-smollm2-135m}
bash scripts/setup.sh
PY=.venv/bin/python
echo "== profiling this machine -> profiles/local.yaml" >&2
$PY plan.py profile -o profiles/local.yaml
echo "== planning $MODEL -> plans/local-$MODEL.yaml" >&2
$PY plan.py plan --model "$MODEL" --profile profiles/local.yaml --context 2048 -o "plans/local-$MODEL.yaml"
$PY plan.py explain "plans/local-$MODEL.yaml"
echo "== running a prompt" >&2
$PY execute.py run "plans/local-$MODEL.yaml" --prompt "The capital of France is" --max-tokens 32
