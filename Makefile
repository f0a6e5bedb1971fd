# Entry points for a fresh clone. Every target uses .venv/bin/python directly,
# so nothing depends on an activated venv.
#   make setup      create .venv, install requirements, build Horovod and tfgpt's
#                   fused kernels (idempotent)
#   make test       setup, then the pytest suite (PYTEST_ARGS="-m 'not slow'" to narrow)
#   make demo       setup, then scripts/demo.sh
#   make docs       install requirements-docs.txt into .venv (creating a bare .venv if
#                   there is none; make setup adds the rest), then build the site of
#                   docs/ with mkdocs build --strict into build/site/
#   make clean      remove build/ and runs/ (keeps .venv)
#   make distclean  clean, and remove .venv
SHELL := /bin/bash
PYTHON := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo docs clean distclean

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/run_tests.sh $(PYTEST_ARGS)

demo: setup
	bash scripts/demo.sh

# Needs neither TensorFlow nor Horovod: mkdocstrings reads the API pages' modules
# statically. NO_MKDOCS_2_WARNING hides Material's banner about its end of life
# (May 2027), printed on every build; a warning of the build itself still fails it.
docs:
	test -x $(PYTHON) || $${TFGPT_PYTHON:-python3.11} -m venv .venv
	PYTHON=$(PYTHON) scripts/pip_install.sh --quiet -r requirements-docs.txt
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site

clean:
	rm -rf build runs

distclean: clean
	rm -rf .venv
