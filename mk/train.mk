# The train stage: benchmark and its tests. `make test` runs tests/train (vLLM-marked ones via test-vllm).
.PHONY: bench-train bench-train-compare bench-train-loader bench-reader-start test-train
bench-train: env ## draft training: tokens/s + offline acceptance vs baselines (tiny, CPU); BENCH_ARGS="--preset llama-1b" on a GPU, plus "--states-modes offline,online,hybrid" for issue #31 item 3
	$(PY) bench/train_bench.py --preset tiny --json runs/bench-train.json $(BENCH_ARGS)

bench-train-compare: env ## pipeline train vs speculators' own `speculators train` on one set, same GPU (tiny set on the CPU here; see docs/benchmarks.md for the H200 runs)
	$(PY) -m bench.train_compare --workdir runs/bench-train-compare --build tiny --conversations 40 --epochs-short 1 --epochs-long 2 --max-len 1024 --lr 1e-3 --json runs/bench-train-compare.json $(if $(shell $(PY) -c "import torch; print(torch.cuda.is_available() or '')"),,--speculators-env PYTHONPATH=tests/train/speculators_cpu --speculators-arg=--draft-attn-impl --speculators-arg=sdpa --speculators-arg=--hidden-states-dtype --speculators-arg=float32 --speculators-arg=--num-workers --speculators-arg=0) $(BENCH_ARGS)

test-train: env ## the train stage's tests in the light environment
	$(PY) -m pytest tests/train -m "not vllm and not gpu" $(PYTEST_ARGS)

.PHONY: demo-learned
demo-learned: env ## make demo on a tiny Llama trained for a minute on the stdlib's sources (its acceptance table means something)
	$(PY) -m pipeline.demo --workdir $(DEMO_DIR)-learned --kind learned $(DEMO_ARGS)

bench-train-loader: env ## the training loader's host cost, fp32 against bf16 batches, side by side (CPU)
	$(PY) -m bench.loader_bench --workdir /tmp/loader-bench --json-out runs/loader_bench.json $(BENCH_ARGS)

bench-reader-start: env ## online/hybrid training: loader workers started by spawn vs the fork server, in turns (CPU, tiny)
	$(PY) -m bench.reader_start_bench --workdir /tmp/reader-start --json-out runs/bench-reader-start.json $(BENCH_ARGS)
