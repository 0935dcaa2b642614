# Everything runs from a local virtualenv that the first target creates and later ones reuse.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lint engine-settings-doc operator-manifests podresources-stubs demo test bench bench-live bench-live-prometheus bench-shards eval-shards eval crosscheck agent-demo hardware-wheels clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m compileall -q core agent server >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpufleet-server demo

agent-demo: $(STAMP)
	$(BIN)/gpufleet-agent --simulate hgx-h100 --once

# One pytest-xdist worker per core, each handed whole test modules (loadfile): a module fixture that
# builds something expensive (a recorded cluster, a wheel, a real Prometheus) is built once, on one worker.
# loadgroup, which would balance finer, groups nothing under pytest 9.2 (pytest-xdist issue 1386).
test: lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile

# mypy checks every package under its installed name (gpufleet, gpufleet.agent, gpufleet.server and all
# below them): .mypy-src lays the folders out so, with links, since the editable install maps them by an
# import hook mypy does not run. Its cache lives outside .mypy-src, so a second run checks only what changed.
MYPY_TARGETS := -p gpufleet
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf .mypy-src && mkdir -p .mypy-src/gpufleet
	for f in core/*.py; do ln -s ../../$$f .mypy-src/gpufleet/; done
	ln -s ../../agent .mypy-src/gpufleet/agent && ln -s ../../server .mypy-src/gpufleet/server
	cd .mypy-src && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../.mypy_cache $(MYPY_TARGETS)

bench: $(STAMP)
	$(BIN)/python -m bench.agent_bench
	$(BIN)/python -m bench.replay_bench

# About 7 minutes: 500 and 1,000 fake agents on loopback pulled by a real server.
bench-live: $(STAMP)
	$(BIN)/python -m bench.server_live_bench

# About 5 minutes (needs the prometheus binary): the same fake agents read through a real Prometheus.
bench-live-prometheus: $(STAMP)
	$(BIN)/python -m bench.server_live_bench --ingest prometheus --agents 250 500 1000 --duration 60

# Shards reading a real VictoriaMetrics (needs victoria-metrics): one shard's cycle CPU, 1, 2 and 4 shards.
bench-shards: $(STAMP)
	$(BIN)/python -m bench.shard_bench

# The shards' alerts together against one unsharded server's, the scenario suite replayed from VictoriaMetrics.
eval-shards: $(STAMP)
	$(BIN)/python -m bench.evaluation.shard_union --counts 2,4 --jobless node,fleet

# Precision, recall and time to fire over the scenario suite; rewrites its section of docs/evaluation.md.
eval: $(STAMP)
	$(BIN)/python -m bench.evaluation.detection_eval --seeds 5

# Detection on the agent's own simulator: normal and marginal incidents, and without job attribution
# (each about 50 minutes on 2 cores at 12 seeds).
crosscheck: $(STAMP)
	$(BIN)/python -m bench.evaluation.sim_crosscheck --seeds 12
	$(BIN)/python -m bench.evaluation.sim_crosscheck --seeds 12 --hard
	$(BIN)/python -m bench.evaluation.sim_crosscheck --seeds 8 --unattributed

# Wheels for bench/hardware_check.sh on a lent GPU machine (CPython 3.12 there, nothing to download from):
# the agent's and replay's packages its image lacks, and nvitop-exporter with what it needs (nvitop, psutil)
# for the cost comparison, at the versions the tests here ran. Into .whl, which
# git ignores; the device call carries it.
# What a bare device machine (Python 3.12, nvidia-ml-py and numpy there) needs to run the agent, the server's
# replay and the cost comparisons: the agent's and the server's dependencies, nvitop-exporter and psutil.
HARDWARE_WHEELS := orjson|bcrypt|pyyaml|prometheus.client|msgspec|nvidia-ml-py|nvitop|nvitop-exporter|psutil|grpcio|protobuf|\
	fastapi|fastapi.offline|starlette|uvicorn|httpx|httpcore|anyio|sniffio|idna|certifi|h11|click|pydantic|pydantic.core|\
	annotated.types|typing.extensions|typing.inspection
WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
hardware-wheels: $(STAMP)
	rm -rf .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(WHEEL_PLATFORMS) -d .whl $$($(BIN)/python -m pip list --format=freeze 2>/dev/null \
		| grep -i -E '^($(HARDWARE_WHEELS))==')

# The settings table of docs/detection.md, from EngineConfig's defaults and the comments above its fields.
engine-settings-doc: $(STAMP)
	$(BIN)/python -m bench.docgen.engine_settings

# The PrometheusRule and the Grafana dashboard ConfigMap for the Prometheus Operator, from their sources.
operator-manifests: $(STAMP)
	$(BIN)/python deploy/kubernetes/operator/render.py

# The kubelet PodResources API's Python modules, from agent/kubelet_podresources_v1.proto. Committed, so that
# installing the agent needs no code generator; the generator's version sets the grpcio and protobuf floors
# of the agent extra (pyproject.toml). Laid out as gpufleet/agent/ so the modules import each other by
# their installed names.
GRPC_TOOLS_VERSION := 1.85.1
podresources-stubs: $(STAMP)
	$(BIN)/python -m pip install --quiet 'grpcio-tools==$(GRPC_TOOLS_VERSION)'
	rm -rf .protogen && mkdir -p .protogen/gpufleet/agent
	cp agent/kubelet_podresources_v1.proto .protogen/gpufleet/agent/
	cd .protogen && ../$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		gpufleet/agent/kubelet_podresources_v1.proto
	cp .protogen/gpufleet/agent/kubelet_podresources_v1_pb2*.py* agent/
	rm -rf .protogen

clean:
	rm -rf $(VENV) build *.egg-info
