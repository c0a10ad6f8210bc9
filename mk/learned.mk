# A target that has learned something (issue #17 item 4): bench/learned_bench.py, results in docs/benchmarks-history.md.
.PHONY: bench-learned bench-learned-tiny
bench-learned: env ## one GPU: train a ~170M Llama on installed packages' sources, then prepare/extract/weights/train a draft; acceptance vs baselines. BENCH_ARGS="--states-modes offline,online,hybrid" also trains it on states produced while it trains (issue #31): acceptance and tok/s per mode vs offline
	PYTHONPATH=. $(PY) bench/learned_bench.py --preset h200 --json runs/bench-learned.json $(BENCH_ARGS)

bench-learned-tiny: env ## the same recipe on the CPU with a tiny model (minutes; checks the path, its figures mean little)
	PYTHONPATH=. $(PY) bench/learned_bench.py --preset tiny --workdir runs/bench-learned-tiny --json runs/bench-learned-tiny.json $(BENCH_ARGS)
