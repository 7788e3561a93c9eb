#!/bin/bash
cd /work/main
start=$(date +%s)
while :; do
  l=$(cut -d' ' -f1 /proc/loadavg)
  echo "$(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> bench/results-committed/issue18/ab/wait.log
  if awk "BEGIN{exit !($l < 3)}"; then echo "quiet" >> bench/results-committed/issue18/ab/wait.log; break; fi
  if [ $(( $(date +%s) - start )) -ge 2100 ]; then echo "gave up waiting" >> bench/results-committed/issue18/ab/wait.log; break; fi
  sleep 30
done
echo "runs start $(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> bench/results-committed/issue18/ab/wait.log
for i in 1 2 3 4 5; do .venv/bin/python -m llmdd._bench.cpp row --out bench/results-committed/issue18/cpp_row_$i.json 3 > bench/results-committed/issue18/ab/row_$i.out 2> bench/results-committed/issue18/ab/row_$i.err; done
echo "runs end $(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> bench/results-committed/issue18/ab/wait.log
for i in 1 2; do
  LLMDD_CPP_BUILD=/tmp/old/build .venv/bin/python -m llmdd._bench.cpp row --out bench/results-committed/issue18/ab/old_$i.json 3 > /dev/null 2> bench/results-committed/issue18/ab/old_$i.err
  .venv/bin/python -m llmdd._bench.cpp row --out bench/results-committed/issue18/ab/new_$i.json 3 > /dev/null 2> bench/results-committed/issue18/ab/new_$i.err
done
echo "all done $(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> bench/results-committed/issue18/ab/wait.log
