#!/bin/bash
# Session 27: the 32K pair with power again (the first call's JSON and power samples did not come back: more than 8
# files); the logs as one tarball so that at most 5 files return.
FINAL=$OUT; mkdir -p /tmp/p; export OUT=/tmp/p
bash bench/results/runs/s24/oneoff/s24_pair_power.sh
cp /tmp/p/s32768_on_none_pair_power.json /tmp/p/smi_pair.csv /tmp/p/pair.md /tmp/p/log_times.json $FINAL/
tar czf $FINAL/e2e_logs.tgz -C /tmp/p e2e_logs logs_ls.txt pair.log
