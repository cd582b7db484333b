"""Map every GPU kernel of a torch.profiler trace to the CPU ops that launched it; aggregate the small ones."""
import bisect, collections, json, sys
tr = json.load(open(sys.argv[1]))
ev = tr["traceEvents"]
kern = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
rt = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
ops = collections.defaultdict(list)
for e in ev:
    if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and e.get("ph") == "X":
        ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
for tid in ops:
    ops[tid].sort()
def stack(tid, ts):
    out = []
    for a, b, n in ops.get(tid, []):
        if a > ts: break
        if b >= ts: out.append(n)
    return out
agg = collections.defaultdict(lambda: [0.0, 0])
for k in kern:
    r = rt.get(k.get("args", {}).get("correlation"))
    st = stack(r["tid"], r["ts"]) if r else []
    inner = [s for s in st if s.startswith("aten::") or s.startswith("triton") or "Triton" in s]
    ag = [s for s in st if "Backward" in s or "backward" in s]
    comp = [s for s in st if s.startswith("Torch-Compiled") or s.startswith("CompiledFunction")]
    mods = [s for s in st if s.startswith("nn.Module") or "## " in s]
    key = (k["name"][:70], inner[-1] if inner else "-", (ag[-1] if ag else "-")[:60], (comp[-1] if comp else "-")[:40])
    agg[key][0] += k["dur"] / 1e3
    agg[key][1] += 1
skip = ("nvjet", "cutlass", "_ws_kernel", "_score_kernel", "_select_kernel", "_adam_kernel")
rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
tot = sum(v[0] for v in agg.values())
print(f"total kernel ms {tot:.1f}")
for (name, inner, ag, comp), (ms, n) in rows:
    if any(s in name for s in skip) or ms < 0.3: continue
    print(f"{ms:8.2f} {n:4d} | {name} | {inner} | {ag} | {comp}")
