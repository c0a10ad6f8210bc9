.PHONY: bench-extract
bench-extract: env ## extract throughput: ours vs naive, side by side (CPU here; --preset llama-1b on a GPU)
	$(PY) bench/extract_bench.py --preset tiny $(BENCH_ARGS)
