# The two commands: `make demo` and `make test`. Both install into .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
# The CPU build here; on a GPU machine install your CUDA torch into .venv first, or set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
DATA ?=
PIP = $(VENV)/bin/pip

.PHONY: install demo test clean slurm-deps

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PIP) install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

# Prepares a corpus (the Python reference shipped with CPython, or DATA=file or Hugging Face dataset
# name) into a Megatron indexed dataset with a trained tokenizer, trains the tiny GRT on it for 300
# steps on CPU, evaluates it and prints a sample.
demo: install
	rm -rf runs/demo
	$(VENV)/bin/grt-prepare-data --input $(or $(DATA),builtin:pydoc_topics) --output-prefix runs/demo/data/corpus \
		--train-tokenizer --vocab-size 2048
	$(VENV)/bin/grt-train model=tiny train=cpu data=runs/demo/data/corpus run.dir=runs/demo train.sample_tokens=160

# The SLURM tests start a real single-node SLURM cluster on loopback from Debian's packages. As root with
# apt, `make test` installs them (about 6 s); elsewhere those tests are skipped, saying so.
SLURM_PACKAGES = slurmctld slurmd slurm-client munge
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
		&& command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(SLURM_PACKAGES) (Debian) for the SLURM tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(SLURM_PACKAGES) >/dev/null; }; \
	else echo "SLURM tests will be skipped: install $(SLURM_PACKAGES) (Debian) as root to run them"; fi

# Two test processes (pytest-xdist), each taking whole files: most tests are subprocesses that spend
# their time importing torch, megatron-core and DeepSpeed on one core. TEST_WORKERS=1 runs them in one.
# Each worker and the processes its tests start get cores / workers torch threads (tests/conftest.py).
TEST_WORKERS ?= 2
test: install slurm-deps
	$(VENV)/bin/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=15

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
