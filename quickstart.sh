#!/usr/bin/env bash
# Strata in one command: install into .venv, then run a prompt on a catalog model with no plan or
# profile given (the first run fetches the model, profiles this machine once and plans the model;
# both are kept in the cache and reused). MODEL=gemma3-270m or a GGUF path, PROMPT="..." to change.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/strata run "${MODEL:-smollm2-135m}" --prompt "${PROMPT:-The capital of France is}"
