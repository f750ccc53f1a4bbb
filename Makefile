# The two commands: `make demo` and `make test`. Both install into .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
# The CPU build here; on a GPU machine install your CUDA torch into .venv first, or set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
DATA ?=
PIP = $(VENV)/bin/pip

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PIP) install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

# Trains the tiny GRT for 300 steps on CPU (the Python reference shipped with CPython, or DATA=path
# or a Hugging Face dataset name), evaluates it and prints a sample.
demo: install
	rm -rf runs/demo
	$(VENV)/bin/grt-train model=tiny train=cpu run.dir=runs/demo train.sample_tokens=160 \
		$(if $(DATA),data=$(DATA))

test: install
	$(VENV)/bin/python -m pytest tests

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
