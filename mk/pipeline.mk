.PHONY: bench-extract
bench-extract: env ## extract throughput: ours vs naive, side by side (CPU here; --preset llama-1b on a GPU)
	$(PY) -m bench.extract_bench --preset tiny $(BENCH_ARGS)

.PHONY: bench-scaling bench-verify
bench-scaling: env ## extract --data-parallel 1 vs 2 (+ dd, verify, naive loop); on a GPU host: BENCH_ARGS="--preset llama-1b --samples 1024 --sweep 1,2,1,2"
	$(PY) -m bench.scaling_bench --preset tiny --sweep 1,2 --out-root /tmp/scaling-bench $(BENCH_ARGS)

bench-verify: env ## verify's read rate vs dd and a naive torch.load loop (no GPU needed); BENCH_ARGS="--dir /dev/shm/vb --gb 6 --hidden 2048"
	$(PY) -m bench.verify_bench --dir /tmp/verify-bench --gb 1 $(BENCH_ARGS)

.PHONY: bench-cli-startup
bench-cli-startup: env ## wall time of `pipeline --help`, stage --help and check-args refusals (fresh processes, median of 3); BENCH_ARGS="--baseline /tmp/base"
	$(PY) -m bench.cli_startup_bench --repeat 3 $(BENCH_ARGS)

# issue #21's whole-process and loop benchmarks; the H200 runs and their commands are in docs/benchmarks.md
.PHONY: bench-e2e bench-hf-levers
bench-e2e: env ## whole process: `pipeline extract` (default flags) vs the naive script, fresh processes, one set (tiny, CPU); on a GPU: BENCH_ARGS="--shapes llama-1b,llama-8b --samples 1024,256 --workdir /dev/shm/e2e"
	$(PY) -m bench.e2e_bench --shapes tiny --samples 24 --seq-length 256 --workdir /tmp/e2e-bench --json-out runs/bench-e2e.json $(BENCH_ARGS)

bench-hf-levers: env ## the hf loop's speed levers one at a time (packed, compiled, batch size) with their error vs fp32 (tiny, CPU); on a GPU: BENCH_ARGS="--shapes llama-1b,llama-8b --samples 192,64"
	$(PY) -m bench.hf_levers --shapes tiny --samples 8 --seq-length 256 --variants plain-16k,packed-32k --fp32-reference --json-out runs/bench-hf-levers.json $(BENCH_ARGS)
