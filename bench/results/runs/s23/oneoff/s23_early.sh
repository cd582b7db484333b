# Ran in session 23 on branch s22-early-prologue rebased onto aa26bf2 (de237f4; its TUNE keys early_q / early_qdo
# are not on main: measured no gain, not merged). Output: ../early_prologue_ab.log and ../*_early.json.
# Prepared in session 22 on branch s22-early-prologue (not measured there: no device time left). Each Gluon sparse
# MLA kernel's prologue (the row's Q / dO copies) no longer waits before the partitions start when
# TUNE[...]["early_q"/"early_qdo"] is set: the copies arrive on an mbarrier, the loaders gather meanwhile and the
# consumers wait for it before their first product (part 1's consumers then form Delta themselves, dO from shared
# memory, instead of the prologue). GPU tests first (timeouts: a wrong barrier hangs), then A/B.
source bench/gpu_env.sh >/dev/null
timeout 200 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "sparse_mla_ws" > /tmp/t.log 2>&1; echo "pytest rc $?"
tail -4 /tmp/t.log
timeout 150 python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"early_qdo": true}' '{}' > /tmp/g.log 2>&1; echo "grad rc $?"
grep RESULT /tmp/g.log
timeout 150 python3 bench/ws_bwd_sweep.py bwd_ps '{}' '{"early_qdo": true}' '{}' > /tmp/p.log 2>&1; echo "ps rc $?"
grep RESULT /tmp/p.log
timeout 100 python3 bench/ws_fwd_probe.py base > /tmp/f0.log 2>&1; grep RESULT /tmp/f0.log
timeout 100 python3 bench/ws_fwd_probe.py '{"early_q": true}' > /tmp/f1.log 2>&1; echo "fwd rc $?"; grep RESULT /tmp/f1.log
