#!/usr/bin/env bash
# One command for a lent GPU machine: set up what is missing from wheels brought along, then measure.
#
#   launch/gpu_check.sh --out OUT_DIR      (or: make gpu-check OUT=OUT_DIR; `launch/gpu_check.sh OUT_DIR` too)
#
# Expects a CUDA machine with torch (and, ideally, transformers) but possibly without deepspeed, wandb, megablocks
# and without network access. Wheels are taken from $WHEELS (default .whl/, see `make gpu-wheels`, which builds
# deepspeed's pure-Python wheel and downloads hjson/pydantic for the GPU machine's Python); MegaBlocks' sources from
# $WHEELS/src are built only if its wheels are not there. Then, each step logged to OUT_DIR/logs/<step>.log with its
# exit code and time in OUT_DIR/summary.txt:
#   env        nvidia-smi, nvcc, versions, which SDPA backend MLA's head dims get
#   tests      the GPU-marked tests (pytest -m gpu)
#   bench_moe  python -m moe_lm.bench moe --device cuda --dtype bfloat16 (ours grouped_mm, MegaBlocks when installed,
#              HF eager and grouped_mm, a dense MLP of equal active FLOPs) at the GPU shapes
#   bench_loss python -m moe_lm.bench loss --device cuda --dtype bfloat16: the head's loss on gpu_1b's 8 x 2048 tokens,
#              plain vs chunked (performance.loss_chunk): peak memory and time
#   bench_train python -m moe_lm.bench train --peers --config gpu_1b --device cuda --dtype bfloat16: the whole step,
#              ours (eager, compiled) vs HF DeepseekV3ForCausalLM (eager, grouped_mm experts) vs the dense twin
#   train      `deepspeed --num_gpus 1 launch/train.py --config gpu_1b` for $STEPS steps (default 120)
#              on the default corpus (prepared here if data/gpu is absent), no checkpoint
#   summary    tokens/s, MFU, peak memory (against `moe-lm estimate`'s), losses, from metrics.jsonl
set -u
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --out) OUT=${2:?--out needs a folder} ;;
  ""|-*) echo "error: give the output folder: launch/gpu_check.sh --out OUT_DIR (--help explains)" >&2; exit 2 ;;
  *) OUT=$1 ;;
esac
WHEELS=${WHEELS:-.whl}
STEPS=${STEPS:-120}
PY=${PYTHON:-python3}
mkdir -p "$OUT/logs"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 MOE_LM_CPU_KERNEL=0 DS_ACCELERATOR=cuda PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SITE=${SITE:-/tmp/moe_lm_site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record exit code and seconds
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  return $rc
}

if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA GPU visible to $PY (torch.cuda.is_available() is false): nothing to check" | tee -a "$SUMMARY"
  exit 1
fi

# 1. what is missing, installed from the wheels brought along (never from the network)
missing=$($PY - <<'PY'
import importlib.util
need = ["deepspeed", "hjson", "pydantic", "msgpack", "cpuinfo", "ninja", "einops", "sentencepiece", "safetensors", "yaml",
        "datasets", "transformers", "wandb"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing here: $missing; installing from $WHEELS" | tee -a "$SUMMARY"
  mkdir -p "$SITE"
  if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl > "$OUT/logs/install.log" 2>&1
  fi
  still=$($PY -c "import importlib.util; print(' '.join(n for n in '$missing'.split() if importlib.util.find_spec(n) is None))")
  [ -n "$still" ] && echo "still missing after the install: $still (bring their wheels in $WHEELS)" | tee -a "$SUMMARY"
fi
# found is not the same as importable: name what DeepSpeed itself still lacks
$PY -c 'import deepspeed' > "$OUT/logs/import_deepspeed.log" 2>&1 \
  || echo "deepspeed does not import: $(tail -n 1 "$OUT/logs/import_deepspeed.log")" | tee -a "$SUMMARY"
if ! $PY -c 'import megablocks' 2>/dev/null && ls "$WHEELS"/src/*.tar.gz > /dev/null 2>&1; then
  (step megablocks_build 480 $PY -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$WHEELS"/src/*.tar.gz) &
fi

step env 120 bash -c "nvidia-smi; nvcc --version; $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; $PY -m pip list 2>/dev/null | grep -iE 'torch|deepspeed|transformers|megablocks|triton'"
step tests 600 $PY -m pytest -q -m gpu tests -p no:cacheprovider
wait  # the MegaBlocks build, if any, before the benchmark that times it
step bench_moe 600 $PY -m moe_lm.bench moe --device cuda --dtype bfloat16 --reps 20
step bench_loss 300 $PY -m moe_lm.bench loss --device cuda --dtype bfloat16 --tokens 16384 --chunks 0 2048 4096 --rounds 2 --iters 5
step bench_train 900 $PY -m moe_lm.bench train --peers --config gpu_1b --device cuda --dtype bfloat16 --rounds 5 --warmup 2
DATA=data/gpu
[ -f "$DATA/meta.json" ] || step prepare 600 $PY launch/prepare_data.py --config gpu_1b --workers 8
DS=$(command -v deepspeed || echo "$SITE/bin/deepspeed")
step train 900 $PY "$DS" --num_gpus 1 launch/train.py --config gpu_1b train.max_steps=$STEPS \
  optim.warmup_steps=20 cadence.eval_interval=$STEPS cadence.ckpt_interval=0 train.out_dir="$OUT/run" \
  logging.wandb_mode=disabled cadence.log_interval=10
$PY launch/estimate_memory.py --config gpu_1b --world 1 > "$OUT/logs/estimate.log" 2>&1
$PY - "$OUT" >> "$SUMMARY" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(r) for r in (out / "run" / "metrics.jsonl").read_text().splitlines()] if (out / "run" / "metrics.jsonl").is_file() else []
train = [r for r in rows if r["kind"] == "train"]
if not train:
    print("train: no metrics (see logs/train.log)")
    sys.exit()
steady = train[len(train) // 3 :]  # after compilation/warm-up
print(f"train: {len(train)} logged steps; steady state (last two thirds): median {statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s, "
      f"MFU {100 * statistics.median(r['mfu'] for r in steady):.1f} %, peak memory {max(r.get('peak_mem_gib', 0) for r in train):.1f} GiB")
print(f"loss: step {train[0]['step']} {train[0]['loss']:.3f} -> step {train[-1]['step']} {train[-1]['loss']:.3f}")
est = (out / "logs" / "estimate.log").read_text().strip().splitlines()
print("estimate: " + (est[-1].strip() if est else "n/a"))
PY
tar czf "$OUT/logs.tgz" -C "$OUT" logs
cat "$SUMMARY"
