# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install bf16opt, run the main job
#   make test   - create .venv, install bf16opt with test extras, run the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first and explicitly: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e '.[plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m bf16opt compare --out runs/compare

# worksteal: each worker starts on its own half of the suite (neighbouring tests share kernel
# configurations, which both workers would otherwise compile at once), then takes over the
# other's remaining tests
test: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=ci $(BIN)/pytest -n auto --dist worksteal

clean:
	rm -rf $(VENV) build dist *.egg-info
