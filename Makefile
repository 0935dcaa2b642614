# Everything runs from a local virtualenv that the first target creates and later ones reuse.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench agent-demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpufleet-server demo

agent-demo: $(STAMP)
	$(BIN)/gpufleet-agent --simulate hgx-h100 --once

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.agent_bench
	$(BIN)/python -m bench.replay_bench

clean:
	rm -rf $(VENV) build *.egg-info
