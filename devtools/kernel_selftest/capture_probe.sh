#!/bin/bash
# GPU host: which stream-capture scenarios a forward variant library survives (capture_probe.cc),
# each in its own process, with the driver's default lazy module loading and with eager loading;
# then, default loading and thread-local mode, capture into an existing graph (as XLA records) and
# a device query on the capturing stream before the launch.
# Usage, from the repo root: bash devtools/kernel_selftest/capture_probe.sh [LIB.so]
# (default: the bf16 head_dim 128 causal forward of .kcache/). Needs .selftest/capture_probe
# (`python devtools/kernel_selftest/build.py --capture-probe` on the build host).
set -u
lib=${1:-$(ls .kcache/fwd-sm90a-bf16-d128-dv128-causal-*/libjaxflash_variant.so | head -1)}
echo "library: $lib"
for loading in default EAGER; do
  for mode in thread global relaxed; do
    for warm in 0 1; do
      for thread in same other; do
        if [ "$loading" = EAGER ]; then
          line=$(CUDA_MODULE_LOADING=EAGER timeout 60 .selftest/capture_probe --mode "$mode" \
                 --warm "$warm" --thread "$thread" "$lib" 2>&1 | tail -1)
        else
          line=$(timeout 60 .selftest/capture_probe --mode "$mode" --warm "$warm" \
                 --thread "$thread" "$lib" 2>&1 | tail -1)
        fi
        echo "loading=$loading $line"
      done
    done
  done
done
for to_graph in 0 1; do
  for get_device in 0 1; do
    for thread in same other; do
      line=$(timeout 60 .selftest/capture_probe --mode thread --warm 0 --thread "$thread" \
             --to-graph "$to_graph" --get-device "$get_device" "$lib" 2>&1 | tail -1)
      echo "loading=default $line"
    done
  done
done
