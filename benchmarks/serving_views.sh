#!/bin/sh
# The verify budget judged where prediction pays (issue 49): the goodput planner fed the trained expected-acceptance
# head against the same planner fed D-Cut's and vLLM's free signals, SmartSpec's K and constant K, decoded live with
# continuous batching on the confirmation prompts, priced under two accelerator views (roofline presets, modelled per
# batch size) and the CPU's measured curves. Evals of one torch thread each, two at a time on 2 cores; each
# resumes from its journal when run again. The 160 confirmation prompts at B = 8 and 32; at B = 128 and 256 the
# queue holds two samples of each (320 requests, --test-samples 2) so that B = 256 fills; the CPU's curves on the
# first 80 prompts, two samples each (160 requests: eval refuses a batch size above the requests it decodes, so
# that B = 128 fills). The evaluated head is the expected-acceptance head (trained with
# configs/train/expected-acceptance.yaml): the planners read it, and its stop rule 1 - prod a > h is one of the
# per-request rows (h = 0.6, the on-time head's dev-tuned value, given, not tuned here).
#   sh benchmarks/serving_views.sh EXPECTED_HEAD DATA [OUT]
set -e
EXPECTED=$1 DATA=$2 OUT=${3:-runs/serving}
COMMON="--head $EXPECTED --data $DATA --device cpu --progress false --bootstrap 1000
  --decode-prompts benchmarks/prompts/heldout_confirm.jsonl --max-new-tokens 16 --max-draft 8
  --fixed-thresholds {\"constant_k\":3,\"confidence\":0.2,\"head\":0.6,\"oracle\":8}"
ACCELERATORS="--serving-costs [h100-llama3.1-8b-llama3.2-1b,4xh100-llama3.1-70b-llama3.1-8b]
  --serving-batch-policies [goodput,dcut,vllm_adaptive,smartspec]"
OMP_NUM_THREADS=1 specheads eval $COMMON $ACCELERATORS --num-decode-prompts 160 --out "$OUT/accelerators-160" \
  --serving-batch-sizes "[8, 32]" > "$OUT-accelerators-160.log" 2>&1 &
OMP_NUM_THREADS=1 specheads eval $COMMON $ACCELERATORS --num-decode-prompts 160 --test-samples 2 \
  --out "$OUT/accelerators-queue" --serving-batch-sizes "[128, 256]" > "$OUT-accelerators-queue.log" 2>&1 &
wait
OMP_NUM_THREADS=1 specheads eval $COMMON --num-decode-prompts 80 --test-samples 2 --out "$OUT/cpu" \
  --serving-batch-sizes "[8, 32, 128]" \
  --serving-costs measured --serving-batch-policies "[goodput, smartspec]" > "$OUT-cpu.log" 2>&1
