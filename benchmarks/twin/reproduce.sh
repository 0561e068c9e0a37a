#!/usr/bin/env bash
# Every result under benchmarks/results/twin/, in order (about 2 h on 2 cores; points
# already written are skipped, so an interrupted run resumes where it stopped).
set -euo pipefail
cd "$(dirname "$0")/../.."
twin() { .venv/bin/python -m benchmarks.twin "$@"; }

# FCFS against the RTX 5090 figures: vLLM's own FCFS, then FCFS through kvtether.
twin calibrate --seeds 0 1 2 --distinct
twin calibrate --policy fcfs --seeds 0 1

# The sweeps: fcfs, continuum, contextserve, adaptive x 1, 2, 4, 8, 12 jobs/s x 5402,
# 3000, 9000, 13000 blocks; the calibrated workload (a shared script), then jobs that
# share nothing, then the 11-turn agent with log-normal tool times (a shared script).
twin sweep --answer-agreement 0.966
twin sweep
twin sweep --kind long --answer-agreement 0.966 --policies fcfs continuum adaptive
# vLLM's own scheduler beside them, and two more seeds where the policies differ.
twin sweep --answer-agreement 0.966 --policies native --blocks 5402 3000
twin sweep --policies native --blocks 5402 3000
for seed in 1 2; do
  twin sweep --answer-agreement 0.966 --seed "$seed" --jps 2 8 12 --blocks 5402 3000
  twin sweep --seed "$seed" --jps 1 2 4 --blocks 5402 3000
done
# CI scale.
twin sweep --quick
# The adaptive policy's acceptance criteria on those points (exit 1 when one misses).
twin criteria reference-agree0.966 long-agree0.966 reference \
  --out benchmarks/results/twin/criteria.md || true
# The form git keeps: one pack a label (commit the packs, not the folders).
twin pack reference-agree0.966 reference long-agree0.966 \
  reference-agree0.966-seed1 reference-agree0.966-seed2 reference-seed1 reference-seed2
