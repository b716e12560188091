# The two commands of README: `make train` (the main job) and `make test` (the suite).
# Both run scripts/setup.sh first, which installs what is missing and returns
# in well under a second when everything is already set up.

PY      := $(or $(HPCTRAIN_VENV),.venv)/bin/python
NP      ?= 4
CONFIG  ?= examples/mlp.toml
MPIRUN  ?= mpirun --oversubscribe
# Open MPI refuses to run as root without these; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup train train-gpt sample-gpt test bench info clean

setup:
	@bash scripts/setup.sh

data/synth-train.h5: | setup
	$(PY) -m hpctrain data synth --out $@ --n 65536 --seed 1

data/synth-eval.h5: | setup
	$(PY) -m hpctrain data synth --out $@ --n 8192 --seed 2

train: setup data/synth-train.h5 data/synth-eval.h5
	$(MPIRUN) -n $(NP) $(PY) -m hpctrain train --config $(CONFIG)

# The GPT example: a byte-level corpus of the Python standard library's own source (~30 MB, seconds to make),
# then a ~1 M-parameter GPT on 2 ranks (a GPU if visible, else the CPU); sample-gpt prints text from its final checkpoint.
data/text.h5: | setup
	$(PY) -m hpctrain data text --out $@

train-gpt: setup data/text.h5
	$(MPIRUN) -n 2 $(PY) -m hpctrain train --config examples/gpt.toml

sample-gpt: setup
	$(PY) -m hpctrain sample --checkpoint $$(ls runs/gpt/ckpt/ckpt-*.h5 | tail -n 1) --prompt "def " --tokens 300

test: setup
	@bash scripts/test.sh

bench: setup
	$(PY) benchmarks/train_throughput.py --ranks 1 2 4

info: setup
	$(MPIRUN) -n $(NP) $(PY) -m hpctrain info

clean:
	rm -rf data runs .test-logs
