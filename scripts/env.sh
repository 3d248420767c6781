# Source me (`source scripts/env.sh`) for a shell that runs vqpipe as the pipeline does: the
# project's .venv first on PATH and the policy's CPU BLAS preloaded (vqpipe/blas.py; VQPIPE_BLAS
# picks the policy, default auto). Python code and notebooks started from this shell get it too.
_vqpipe_root=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
export PATH="$_vqpipe_root/.venv/bin:$PATH"
eval "$("$_vqpipe_root/.venv/bin/python" -m vqpipe.blas --exports)"
unset _vqpipe_root
