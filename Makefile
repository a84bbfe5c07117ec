# Two entry points: `make demo` (the main job) and `make test` (the whole suite, lint included).
# Both create or reuse the virtualenv at .venv/ with a Python 3.12 found by scripts/find_python.sh.
# A crashed test worker ends the run (a replacement could leave pytest-xdist waiting on the
# tests the lost one held).
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || "$$(scripts/find_python.sh)" -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev,train]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m mtpjax demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile --max-worker-restart=0 -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
