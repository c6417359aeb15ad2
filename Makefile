# Two commands set everything up from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnkit demo --out attnkit-out

test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/attnkit bench

clean:
	rm -rf $(VENV) attnkit-out
