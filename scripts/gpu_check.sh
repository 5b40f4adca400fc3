#!/usr/bin/env bash
# One run on a lent GPU (the device tool): the Triton kernels tested without the interpreter, then
# the benchmarks of results/bench on CUDA. Prepared here so that a session with a device spends its
# minutes measuring. Uses the machine's own python3 (PyTorch with CUDA, Triton) and this checkout
# on PYTHONPATH, no install; the peers travel as wheels (`make gpu-wheels`, then carry `.whl`):
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# Everything lands in $OUT (one log plus one JSON per benchmark, 7 files: under the tool's 8; a
# bench's stdout, its JSON again, is dropped, its table on stderr stays in the log); copy
# the JSONs into results/bench/ and run `attnres bench report`. Each step has its own time limit
# and a failing step does not stop the next (the limits add up to 505 s; the op bfloat16 step
# includes torch.compile). DEVICE=cpu QUICK=1 rehearses the script on a CPU.
set -u
OUT=${OUT:-/tmp/gpu_check}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
q=${QUICK:+--quick}

step() {  # step SECONDS NAME CMD...: run with a limit, report the status (on stderr), go on
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)" >&2
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0))s" >&2
}
BENCH=("$PY" -m attention_residuals.cli bench)

command -v nvidia-smi > /dev/null && nvidia-smi -L
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
step 120 "kernel tests" "$PY" -m pytest -p no:cacheprovider -rfEs tests/unit/kernels/test_kernels.py
step 110 "op bfloat16" "${BENCH[@]}" op --device "$DEVICE" --dtype bfloat16 --repeats 20 $q --json "$OUT/op_${DEVICE}_bfloat16.json" > /dev/null
# warps per program, 4 against the kernels' 8 (chosen from the sm_90 register counts of
# scripts/triton_aot.py, not yet timed): forward and backward alone, best of 20, printed to the log
[ "$DEVICE" = cuda ] && step 30 "triton warps" "$PY" - <<'EOF'
import torch
from attention_residuals.kernels import triton_kernels as tk

def best(fn, reps=20):
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); fn(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)

for dtype in (torch.bfloat16, torch.float32):
    for n, m, d, heads in ((9, 4096, 1024, 1), (17, 4096, 768, 4)):
        v = torch.randn(n, m, d, device="cuda").to(dtype)
        q, g = 0.1 * torch.randn(d, device="cuda"), torch.randn(m, d, device="cuda").to(dtype)
        roof = best(lambda: v.sum())
        for warps in (4, 8):
            tk._NUM_WARPS = warps
            _, lse = tk.forward(q, v, 1e-6, heads, True)
            fwd = best(lambda: tk.forward(q, v, 1e-6, heads, True))
            bwd = best(lambda: tk.backward(q, v, lse, g, 1e-6, heads, True))
            print(f"{dtype} N={n} M={m} d={d} H={heads} warps={warps}: sum {roof:.3f} ms, "
                  f"forward {fwd:.3f} ms ({roof / fwd:.2f} of the roofline), backward {bwd:.3f} ms")
EOF
step 45 "op float32" "${BENCH[@]}" op --device "$DEVICE" --dtype float32 --repeats 20 --no-compile $q --json "$OUT/op_${DEVICE}_float32.json" > /dev/null
# N = 9 sources of 8 x 4096 tokens x 4096 channels (2.4 GB in bfloat16): long enough to time the memory
# stream (--quick, the rehearsal, overrides the shape)
step 60 "op bfloat16 large" "${BENCH[@]}" op --device "$DEVICE" --dtype bfloat16 --repeats 20 --no-compile $q \
  --batch 8 --seq 4096 --dim 4096 --json "$OUT/op_${DEVICE}_bfloat16_large.json" > /dev/null
step 55 "model" "${BENCH[@]}" model --device "$DEVICE" --dtype bfloat16 --repeats 10 $q --json "$OUT/model_${DEVICE}.json" > /dev/null
step 55 "peers" "${BENCH[@]}" peers --device "$DEVICE" --dtype bfloat16 --repeats 10 $q --json "$OUT/peers_${DEVICE}.json" > /dev/null
step 30 "memory" "${BENCH[@]}" memory --device "$DEVICE" --dtype bfloat16 $q --json "$OUT/memory_${DEVICE}.json" > /dev/null
# the page `attnres bench report` makes of these JSONs, last, so the call's output tail shows it
rm -rf /tmp/gpu_check_report && mkdir -p /tmp/gpu_check_report && cp "$OUT"/*.json /tmp/gpu_check_report/ \
  && "${BENCH[@]}" report /tmp/gpu_check_report > /dev/null && cat /tmp/gpu_check_report/README.md
ls -l "$OUT"
