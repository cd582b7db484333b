source bench/gpu_env.sh >/dev/null
D=/tmp/tr32; rm -rf $D
python3 train.py --job.config_file train_configs/glm52_proxy.toml --training.steps 5 --metrics.log_freq 1 --job.dump_folder $D --training.seq_len ${SEQ:-32768} --training.local_batch_size 1 --activation_checkpoint.mode none --data.no-document-masking --dsa.recall_queries 0 --checkpoint.no-enable --metrics.no-enable-tensorboard --compile.enable --mtp.no-enable --profiling.enable_profiling --profiling.save_traces_folder traces --profiling.profile_freq 5 --profiling.profiler_warmup 0 --profiling.profiler_active 1 > $OUT/train_${SEQ:-32768}.log 2>&1 || tail -30 $OUT/train_${SEQ:-32768}.log
T=$(ls $D/traces/iteration_5/*.json | head -1)
python3 .snap/s19_kmap.py $T > $OUT/kmap_${SEQ:-32768}.txt 2>&1
python3 bench/trace_summary.py $T --top 80 > $OUT/summary_${SEQ:-32768}.txt 2>&1
gzip -c $T > $OUT/trace_${SEQ:-32768}.json.gz
ls -la $OUT; head -70 $OUT/kmap_${SEQ:-32768}.txt
