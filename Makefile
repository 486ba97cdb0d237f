# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install bf16opt, run the main job
#   make test   - create .venv, install bf16opt with test extras, run the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first and explicitly, in the build you want. On Linux, PyPI's torch (bare or pinned, as
# here) is the CUDA build, with several GB of CUDA libraries. For the CPU-only build add
# PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
# (pip then takes 2.13.0+cpu, which matches ==2.13.0 and sorts above it).
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
