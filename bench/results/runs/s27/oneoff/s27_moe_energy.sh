# Session 27: energy of the routed experts' products, grouped (torch._grouped_mm, CUTLASS) against one cuBLAS
# product per expert and one dense product of the same FLOPs, at the proxy's 32K shapes; and the head's product in
# both orientations. Two rounds, in turn.
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT
P=moe_w13_grouped,moe_w13_loop,moe_w13_mm,moe_w2_grouped,moe_w2_loop,moe_w2_mm,moe_w13dx_grouped,moe_w13dx_loop,moe_w13dx_mm,moe_w13dw_grouped,moe_w13dw_loop,moe_w13dw_mm,head_gemm,head_gemm_t
OUT=$OUTS timeout 400 python3 bench/energy_probe.py --seconds 3 --rounds 2 --pieces $P 2>&1 | tee $OUTS/energy_moe.log | grep -v "^{"
mv $OUTS/energy_probe.json $OUTS/energy_probe_moe.json 2>/dev/null
