"""Adjacent-query overlap of the indexer's top-k on the random-init proxy (layer 0), corpus tokens, T=4096."""
import json, torch
from titan_glm52.model.args import get_flavor
from titan_glm52.model.model import GLM52Model
from titan_glm52.kernels import reference
from titan_glm52.data.tokenizer import Tokenizer
torch.manual_seed(0)
args = get_flavor("glm52_proxy"); args.num_nextn_predict_layers = 0; args.num_hidden_layers = 1
T = 4096
tok = Tokenizer("titan_glm52/assets/tokenizer")
ids = []
for line in open("titan_glm52/assets/corpus.jsonl"):
    ids += tok.encode(json.loads(line)["text"])
    if len(ids) > T: break
ids = torch.tensor(ids[:T])[None]
model = GLM52Model(args); model.init_weights(0)
cap = {}
orig = reference.indexer_topk
def grab(*a, **k):
    cap["topk"] = orig(*a, **k); raise KeyboardInterrupt
reference.indexer_topk = grab
try:
    with torch.no_grad(): model(ids)
except KeyboardInterrupt:
    pass
tk = cap["topk"]
K = tk.shape[1]
def sets(r): return set(tk[r].tolist()) - {-1}
for gap in (1, 2, 4, 8, 16):
    ov = [len(sets(t) & sets(t + gap)) / K for t in range(K, T - gap, 7)]
    print("gap", gap, "mean overlap", sum(ov) / len(ov))
for blk in (2, 4, 8, 16):
    us = [len(set().union(*[sets(t + i) for i in range(blk)])) / K for t in range(K, T - blk, 61)]
    print("block", blk, "union/K", sum(us) / len(us))
