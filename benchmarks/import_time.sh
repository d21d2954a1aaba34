#!/usr/bin/env bash
# Import time of the CLI's module (what a usage error pays before its one line), this tree against an OLD one on the
# same machine, alternating, 15 times each; prints the median and the range in ms (issue 43: the layer folders).
#   git worktree add /tmp/old OLD_COMMIT; OLD=/tmp/old bash benchmarks/import_time.sh
set -euo pipefail
OLD=${OLD:?the old tree: OLD=/path/to/checkout}
for tree in new old; do : > /tmp/import_$tree.txt; done
for i in $(seq 15); do for tree in new old; do
  if [ $tree = old ]; then cd "$OLD"; else cd "$(dirname "$0")/.."; fi
  PYTHONPATH=$PWD python3 -c "import time; t = time.perf_counter(); import lora_eval.cli; print((time.perf_counter() - t) * 1e3)" >> /tmp/import_$tree.txt
  cd - > /dev/null
done; done
for tree in new old; do
  sort -n /tmp/import_$tree.txt | awk -v t=$tree '{a[NR]=$1} END {printf "%s: median %.1f ms (%.1f-%.1f)\n", t, a[int((NR+1)/2)], a[1], a[NR]}'
done
