"""verify --model's recompute on a GPU: stored vs a batch-1 recompute, and the model against itself
(batch 1 vs the same sample beside another in a batch of 2, and batch 1 twice), per layer; plus argmax
agreement of norm+lm_head on the last layer the same three ways."""
import json, os, sys
from pathlib import Path
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
from pipeline.ondisk import formats
from pipeline.verify import VerifyConfig, _open_target, _rms_norm
from pipeline.model.recompute import rel_err
from pipeline.weights import read_tensors, weight_map
from pipeline.model.modeldir import read_model_dir, resolve_names

states, model = Path(sys.argv[1]), Path(sys.argv[2])
dc = formats.read_data_config(states)
cfg = VerifyConfig(path=states, model=model)
be = _open_target(cfg, dc)
md = read_model_dir(model)
wmap = weight_map(model)
names = resolve_names(sorted(wmap), md.tie_word_embeddings)
t = read_tensors(model, wmap, sorted({names.norm, names.lm_head}))
norm_w, head = t[names.norm].to(DEV).float(), t[names.lm_head].to(DEV).float()
eps = float((md.raw.get("text_config") or md.raw).get("rms_norm_eps", 1e-6))
def am(h):
    return (_rms_norm(h.to(DEV).float(), norm_w, eps) @ head.T).argmax(-1).cpu()
files = sorted(states.glob("data_*.pt"))[:8]
samples = [formats.read_sample(f) for f in files]
rows = []
for i, d in enumerate(samples):
    ids = d["input_ids"].tolist()
    other = samples[(i + 1) % len(samples)]["input_ids"].tolist()
    a = be.capture([ids])[0]
    a2 = be.capture([ids])[0]
    b = be.capture([ids, other])[0]
    c = be.capture([other, ids, ids[: len(ids) // 2]])[1]
    st = d["hidden_states"]
    row = {
        "file": files[i].name, "tokens": len(ids),
        "stored_vs_b1": [round(rel_err(s, x), 4) for s, x in zip(st, a)],
        "b1_vs_b1": [round(rel_err(x, y), 4) for x, y in zip(a2, a)],
        "b2_vs_b1": [round(rel_err(x, y), 4) for x, y in zip(b, a)],
        "b3_vs_b1": [round(rel_err(x, y), 4) for x, y in zip(c, a)],
        "stored_vs_other_layer": [[round(rel_err(s, x), 4) for x in a] for s in st],
        "stored_vs_shift1": [round(rel_err(s[1:], x[:-1]), 4) for s, x in zip(st, a)],
        "agree_stored_b1": float((am(st[-1]) == am(a[-1])).float().mean()),
        "agree_b2_b1": float((am(b[-1]) == am(a[-1])).float().mean()),
        "agree_b3_b1": float((am(c[-1]) == am(a[-1])).float().mean()),
    }
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"states": str(states), "layer_ids": dc.layer_ids, "dtype": dc.dtype, "rows": rows},
          open(os.environ.get("OUT", ".") + f"/noise_probe_{states.name}.json", "w"), indent=1)
