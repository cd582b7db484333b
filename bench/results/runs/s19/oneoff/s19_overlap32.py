import json, sys, torch
from titan_glm52.model.args import get_flavor
from titan_glm52.model.model import GLM52Model
from titan_glm52.kernels import reference
from titan_glm52.data.tokenizer import Tokenizer
torch.manual_seed(0)
args = get_flavor("glm52_proxy"); args.num_nextn_predict_layers = 0; args.num_hidden_layers = 1
T = int(sys.argv[1])
tok = Tokenizer("titan_glm52/assets/tokenizer")
ids = []
for line in open("titan_glm52/assets/corpus.jsonl"):
    ids += tok.encode(json.loads(line)["text"])
    if len(ids) > T: break
print("tokens", len(ids))
ids = torch.tensor((ids * (T // len(ids) + 1))[:T])[None]
model = GLM52Model(args); model.init_weights(0)
cap = {}
def grab(q, k, w, cu, topk, scale, **kw):
    cap.update(q=q, k=k, w=w, topk=topk, scale=scale); raise KeyboardInterrupt
reference.indexer_topk = grab
try:
    with torch.no_grad(): model(ids)
except KeyboardInterrupt:
    pass
q, k, w, K, sc = cap["q"].float(), cap["k"].float(), cap["w"].float(), cap["topk"], cap["scale"]
def topk_rows(rows):
    out = []
    for t in rows:
        s = (torch.relu(q[t] @ k[: t + 1].T) * w[t][:, None]).sum(0) * sc
        out.append(set(s.topk(K).indices.tolist()))
    return out
for base in (T // 2, T - 40):
    S = topk_rows(range(base, base + 17))
    print("base", base, "gap1 overlap", sum(len(S[i] & S[i + 1]) for i in range(16)) / 16 / K,
          "union16/K", len(set().union(*S[:16])) / K, "union2/K", sum(len(S[i] | S[i+1]) for i in range(0,16,2)) / 8 / K)
