# Entry points for a fresh clone. Every target uses .venv/bin/python directly,
# so nothing depends on an activated venv.
#   make setup      create .venv, install requirements, build Horovod and tfgpt's
#                   fused kernels (idempotent)
#   make test       setup, then the pytest suite (PYTEST_ARGS="-m 'not slow'" to narrow)
#   make demo       setup, then scripts/demo.sh
#   make clean      remove build/ and runs/ (keeps .venv)
#   make distclean  clean, and remove .venv
SHELL := /bin/bash
PYTHON := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo clean distclean

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/run_tests.sh $(PYTEST_ARGS)

demo: setup
	bash scripts/demo.sh

clean:
	rm -rf build runs

distclean: clean
	rm -rf .venv
