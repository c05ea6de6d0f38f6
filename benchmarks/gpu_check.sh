#!/usr/bin/env bash
# make gpu-check: the checks of benchmarks/gpu_check.py on a machine with CUDA GPUs and no
# internet. Python packages the machine lacks come from wheels/ (git-ignored; `make
# gpu-wheels` fills it where pip can reach the index) and are installed into a scratch
# folder put first on PYTHONPATH, so the machine's own torch (any CUDA build) is used as it
# is. Results: $GPU_CHECK_OUT (default $OUT when set, else outputs/gpu_check)/gpu_check.json;
# logs and the runs' outputs in $GPU_CHECK_WORK (default: work/ beside the JSON; under $OUT,
# which brings back only a few files, /tmp/longstraw-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out_dir=${GPU_CHECK_OUT:-${OUT:-outputs/gpu_check}}
if [[ -z "${GPU_CHECK_OUT:-}" && -n "${OUT:-}" ]]; then
  work_dir=${GPU_CHECK_WORK:-/tmp/longstraw-gpu-check}
else
  work_dir=${GPU_CHECK_WORK:-$out_dir/work}
fi
site=${GPU_CHECK_SITE:-/tmp/longstraw-gpu-site}
# No NVIDIA GPU here and no --device cpu: print the plan (phases, steps, limits) and exit 0
# in well under a second; the plan's module needs only the standard library, not torch.
if [[ " $* " != *" --device cpu "* && " $* " != *" --device=cpu "* ]] &&
  ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && ! command -v nvidia-smi >/dev/null; then
  exec "$PYTHON" benchmarks/gpu_check_plan.py
fi
"$PYTHON" -c "import torch" 2>/dev/null || {
  echo "gpu-check: $PYTHON has no torch; install a CUDA build of torch first" >&2
  exit 2
}
if compgen -G "wheels/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" wheels/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu-check: no wheels/ (make gpu-wheels): using the packages installed here" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
# The outer limit, from the one place the budget is kept (gpu_check.py's OUTER_LIMIT_S): every
# step's own limit and the start-up fit inside it. At the limit the check gets SIGTERM (it
# ends the running step, records it as killed and writes the JSON), SIGKILL 15 s later.
outer=$("$PYTHON" benchmarks/gpu_check.py --outer-limit)
exec timeout -k 15 "$outer" "$PYTHON" benchmarks/gpu_check.py --out "$out_dir/gpu_check.json" \
  --work "$work_dir" "$@"
