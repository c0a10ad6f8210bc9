# The train stage: benchmark and its tests. `make test` runs tests/train (vLLM-marked ones via test-vllm).
.PHONY: bench-train test-train
bench-train: env ## draft training: tokens/s + offline acceptance vs baselines (tiny, CPU); BENCH_ARGS="--preset llama-1b" on a GPU
	$(PY) bench/train_bench.py --preset tiny --json runs/bench-train.json $(BENCH_ARGS)

test-train: env ## the train stage's tests in the light environment
	$(PY) -m pytest tests/train -m "not vllm" $(PYTEST_ARGS)

.PHONY: demo-learned
demo-learned: env ## make demo on a tiny Llama trained for a minute on the stdlib's sources (its acceptance table means something)
	$(PY) -m pipeline.demo --workdir $(DEMO_DIR)-learned --kind learned $(DEMO_ARGS)
