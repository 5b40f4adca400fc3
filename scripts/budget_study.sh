#!/usr/bin/env bash
# The long studies of results/ (budget, lr, queries, long-ablation, long-scaling, evidence), in the
# order that answers the first questions first: the 12-sublayer model on code and on prose, its
# learning-rate sweep, whether the pseudo-queries learn, the 24-sublayer model, the ablation rows and
# the scaling fit at 20 tokens/param, then the evidence study (3 seeds, whole-split losses, two more
# corpora: `attnres data fetch` first). Every run resumes from its checkpoint and finished runs are
# skipped, so this can be stopped at any point and started again (in another session).
# WORKERS: processes in parallel (each trains every WORKERS-th run, --shard); THREADS: torch threads each.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNRES=${ATTNRES:-.venv/bin/attnres}
T=${THREADS:-1}
W=${WORKERS:-2}

PIDS=()
# a stopped or failed study takes its shards with it: a second start must not train the same runs twice
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM

study() {  # study EXPERIMENT [ARGS...]: W shards in parallel, then the tables
    local i pid rc=0
    PIDS=()
    for ((i = 0; i < W; i++)); do
        $ATTNRES experiment "$@" --preset full --threads "$T" --shard "$i/$W" &
        PIDS+=($!)
    done
    for pid in "${PIDS[@]}"; do wait "$pid" || rc=$?; done
    ((rc == 0)) || exit "$rc"
    $ATTNRES experiment "$@" --preset full --threads "$T"
}

study budget --only code_L12 prose_L12
study lr
study queries
study budget
study long-ablation
study long-scaling
$ATTNRES data fetch >/dev/null
study evidence
