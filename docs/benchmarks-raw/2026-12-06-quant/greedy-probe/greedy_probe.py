"""Greedy output of a MoE target in vLLM: batch 1 vs batch 8 (plain), and plain vs n-gram speculation."""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import random

model = sys.argv[1]
random.seed(0)
prompts = [TokensPrompt(prompt_token_ids=[random.randrange(5, 700) for _ in range(40)] * 2) for _ in range(8)]
sp = SamplingParams(temperature=0, max_tokens=64, detokenize=False)
out = {}
def run(spec):
    llm = LLM(model=model, max_model_len=512, gpu_memory_utilization=0.85, speculative_config=spec, enable_prefix_caching=False, skip_tokenizer_init=True)
    one = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    many = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    import gc, torch; gc.collect(); torch.cuda.empty_cache()
    return [list(x) for x in one], [list(x) for x in many]
p1, p8 = run(None)
out["plain_b1_vs_b8_equal"] = sum(a == b for a, b in zip(p1, p8))
print("plain batch1 vs batch8 equal:", out["plain_b1_vs_b8_equal"], "/ 8", flush=True)
import os
if os.environ.get("NGRAM", "1") == "1":
    n1, n8 = run({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    out["ngram_b1_vs_plain_b1_equal"] = sum(a == b for a, b in zip(n1, p1))
    out["ngram_b8_vs_plain_b8_equal"] = sum(a == b for a, b in zip(n8, p8))
    out["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(n1, p1)]
print(json.dumps(out))
json.dump(out, open(os.environ.get("OUT", ".") + "/greedy_probe.json", "w"))
