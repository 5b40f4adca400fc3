#!/usr/bin/env bash
# The budget study of results/budget, results/lr and results/queries, in the order that answers the
# first questions first: the 12-sublayer model on code and on prose, then its learning-rate sweep,
# then whether the pseudo-queries learn (queries), then the 24-sublayer model. Every run resumes from its checkpoint and finished runs are skipped, so this
# can be stopped at any point and started again (in another session). THREADS: torch threads.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNRES=${ATTNRES:-.venv/bin/attnres}
T=${THREADS:-1}
$ATTNRES experiment budget --budget full --threads "$T" --only code_L12 prose_L12
$ATTNRES experiment lr --budget full --threads "$T"
$ATTNRES experiment queries --budget full --threads "$T"
$ATTNRES experiment budget --budget full --threads "$T"
