# ops: drive a GPU host over SSH. Each target is an alias of `python -m ops ...`; HOST= is a hosts-file
# name, user@host[:port] or `local`; for remote-extract (and remote-run STAGE=verify) HOST=a,b,c runs one
# shard per host in parallel (docs/ops.md "Several hosts"). OPS_ARGS passes extra flags (e.g. --dry-run).
OPS := $(PY) -m ops
HOSTS_FILE ?=
OPS_HOST_ARGS = --host "$(HOST)" $(if $(HOSTS_FILE),--hosts-file "$(HOSTS_FILE)")

.PHONY: gpu-status gpu-clean remote-extract remote-train remote-regenerate remote-run stop-server restore-server test-ops bench-ops ops-test-images

gpu-status: ## per-GPU memory/processes on HOST (protected/server/orphan)
	$(OPS) gpu-status $(OPS_HOST_ARGS) $(OPS_ARGS)

gpu-clean: ## stop the server on HOST, free its GPUs, verify clean (OPS_ARGS=--dry-run for the plan)
	$(OPS) gpu-clean $(OPS_HOST_ARGS) $(OPS_ARGS)

remote-extract: ## preflight, gpu-clean, run `pipeline extract` in the image on HOST, fetch summary
	$(OPS) remote-extract $(OPS_HOST_ARGS) $(OPS_ARGS)

remote-train: ## train the draft on HOST with the hosts file's train table (states mode, budget, GPU split)
	$(OPS) remote-train $(OPS_HOST_ARGS) $(OPS_ARGS)

remote-regenerate: ## rewrite DATA_ROOT/conversations.jsonl's answers through HOST's running server (never stopped)
	$(OPS) remote-regenerate $(OPS_HOST_ARGS) $(OPS_ARGS)

remote-run: ## like remote-extract for STAGE=regenerate|prepare|weights|train|evaluate|verify
	$(OPS) remote-run "$(STAGE)" $(OPS_HOST_ARGS) $(OPS_ARGS)

stop-server: ## stop HOST's inference server by its strategy
	$(OPS) stop-server $(OPS_HOST_ARGS)

restore-server: ## bring HOST's inference server back
	$(OPS) restore-server $(OPS_HOST_ARGS)

ops-test-images: ## the Debian 12 base image the ops tests build their images on (cached)
	bash tests/ops/images/build_base.sh

test-ops: env ## the ops tests only
	$(PY) -m pytest tests/ops $(PYTEST_ARGS)

bench-ops: env ## remote-extract overhead and SSH connection count against a loopback sshd
	$(PY) tests/ops/bench_ops.py

.PHONY: test-ops-vllm
test-ops-vllm: env ## ops against a real `vllm serve` (.venv-vllm with patches/ applied: 0003 lets `vllm` start)
	$(VLLM_READY)
	$(PY) -m pytest -m vllm tests/ops $(PYTEST_ARGS)

# `make test` runs it with the other suites (the Makefile's TEST_SUITES), once the light ops tests are done: it
# shares the Docker engine and test containers with them. MAKE_TEST is set by `make test` alone.
TEST_SUITES += test-ops-vllm
ifeq ($(MAKE_TEST),1)
test-ops-vllm: | test-light-ops
endif

.PHONY: bench-remote-preflight
bench-remote-preflight: env ## remote-extract on a misconfigured run: seconds from the laptop command to the error line
	$(PY) bench/remote_preflight_bench.py --json-out runs/remote_preflight_bench.json $(BENCH_ARGS)

.PHONY: compose-file
compose-file: ## rewrite compose.yaml from the stage table (contract/stages.py STAGES)
	$(PY) -m ops.composefile --write
