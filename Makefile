# The workbook's commands. `make lab` to read and run the chapters, `make test` to check them.
# Both create or refresh .venv first, and only when pyproject.toml or the pins changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PINS := requirements/constraints.txt
# Free disk that creating .venv needs, in GB (it takes about 6.2 installed).
VENV_GB ?= 7
WITH_NB_ENV := tests/with_notebook_env.sh
# The chapters, then the appendices (runnable and tested like the chapters).
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb)) \
  $(sort $(wildcard notebooks/appendix_*.ipynb))
LANDING := notebooks/start_here.ipynb
# A cell that runs past 300 s fails with every thread's stack. No cell should come near it:
# a whole chapter runs within 60 s on a 2-core CPU, with or without native bfloat16
# (mixed precision "auto" picks float32 where bfloat16 would be emulated).
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
  --timeout=300
LAB_PORT ?= 8888
# Jupyter refuses to start as root (containers often run as root) unless told to.
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# Python caches compiled modules (__pycache__/, git-ignored) even where the environment
# asks it not to: a test run starts hundreds of Python processes (ranks, torchrun workers,
# kernels, scripts), each of which would compile the workbook's modules again, and pytest
# would rewrite the tests' asserts again in each run (measured: 0.2 s a process, 3 s a
# collection).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv lab test unit-lane notebook-lane check lint unit nbval nbval-kernels browser slurm-test gpu-check gpu-wheels notebooks \
  nav bench bench-store figures screenshots pins clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(PINS)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	  { echo "error: $(PYTHON) is older than Python 3.10; run 'make PYTHON=python3.11 ...'" >&2; exit 1; }
	@test -x $(BIN)/python || { $(PYTHON) tools/disk_room.py $(VENV) --gb $(VENV_GB) && \
	  echo "Creating $(VENV) with $(PYTHON)" && $(PYTHON) -m venv $(VENV); }
	@echo "Installing the workbook into $(VENV) (pinned by $(PINS); the first time takes minutes)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c $(PINS) -e ".[lab,test]"
	@# Build matplotlib's font cache here, so its notice never lands in a notebook output.
	$(BIN)/python -c "import matplotlib.pyplot"
	@touch $@

# JupyterLab's defaults for this environment: no "get notified about Jupyter news?"
# pop-up, no update checks (a reader can still change both in Settings).
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_OVERRIDES): tools/jupyterlab_overrides.json $(STAMP)
	@mkdir -p $(dir $@)
	cp $< $@

# Opens the landing page: the chapter map, links, and this machine's environment report
# (written afresh at each start; git-ignored).
lab: $(STAMP) $(LAB_OVERRIDES)
	$(BIN)/python tools/chapters.py landing notebooks
	$(WITH_NB_ENV) $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
	  --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/$(LANDING) \
	  $(LAB_ROOT_FLAG)

# Two lanes: the unit tests (the nbval harness's own tests among them: they run `make nbval`
# on small notebooks); and nbval, then the browser test. Placed so, the two lanes take
# about as long (here, in a fresh clone, with the SLURM tests in the unit lane: about
# 610 s each; without SLURM the unit lane is about 60 s shorter). Side by side where the
# machine has 2 CPUs or more: each lane keeps about one core busy. TEST_JOBS=1 runs them
# one after the other. A live timing that a busy second core breaks (chapter 04's second
# thread) is checked on its stored benchmark run instead; the chapters' other live checks
# hold with every core busy (run with a busy loop per core). Each lane prints its reports
# when it ends.
TEST_JOBS ?= $(if $(filter 0 1,$(shell nproc 2>/dev/null || echo 1)),1,2)
test: lint
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) $(if $(filter-out 1,$(TEST_JOBS)),--output-sync=recurse) \
	  unit-lane notebook-lane

unit-lane:
	@$(MAKE) --no-print-directory unit

notebook-lane:
	@$(MAKE) --no-print-directory nbval
	@$(MAKE) --no-print-directory browser

# The fast tier, for contributors between commits: lint and the unit tests not marked
# slow (no trainings, JupyterLab, torchrun or long waits), on one pytest worker per CPU
# (pytest-xdist; CHECK_WORKERS=0 runs them in this process). `make test` before pushing.
CHECK_WORKERS ?= logical
check: lint
	$(BIN)/pytest tests --ignore=tests/browser -m "not slow" -q -n $(CHECK_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check mgpu_helpers tests notebooks benchmarks scripts tools solutions

unit: $(STAMP)
	$(BIN)/pytest tests --ignore=tests/browser $(UNIT_ARGS)

# JupyterLab in a real Chromium (Playwright); skipped, saying so, when Chromium is absent.
# Screenshots go to runs/browser/ (BROWSER_ARTIFACTS=dir to change).
browser: $(STAMP)
	$(BIN)/pytest tests/browser

# The SLURM tests on a one-node cluster of this machine, started for them and stopped after
# (tools/slurm_cluster.py; needs root and Debian's slurmctld slurmd slurm-client munge).
# `make test` runs the same tests on any cluster SLURM_CONF names (.ci/run starts one),
# and skips them, saying so, where it names none.
slurm-test: $(STAMP)
	@folder=$$(mktemp -d /tmp/mgpu-slurm.XXXXXX); \
	conf=$$(python3 tools/slurm_cluster.py start $$folder) || exit 1; \
	trap 'python3 tools/slurm_cluster.py stop '$$folder INT TERM; \
	SLURM_CONF=$$conf MGPU_REQUIRE_SLURM=1 $(BIN)/pytest tests/workbook/test_slurm.py $(TEST_ARGS); \
	status=$$?; python3 tools/slurm_cluster.py stop $$folder; \
	[ $$status -ne 0 ] || rm -rf $$folder; exit $$status

# Which of PyTorch's CPU kernels nbval runs a notebook on is a flag in its metadata
# (metadata.workbook.nbval_kernels, read by tools/chapters.py). "generic": chapters whose
# compared outputs are computed numbers run on PyTorch's generic kernels
# (ATEN_CPU_CAPABILITY=default), standing in for another CPU: their outputs were stored
# with this machine's best kernels, so a number printed past its precision fails here.
# "best" (the default): the others, and chapter 06, whose checks hold pipeline timings to
# the schedules' theory, which assumes pieces of equal time; its pieces are cut at equal
# FLOPs, which the generic kernels turn into unequal times. `make nbval-kernels` runs
# every chapter on KERNELS (default, or avx2...).
KERNELS ?= default
NBVAL_GENERIC := $(shell $(PYTHON) tools/chapters.py kernels generic $(NOTEBOOKS))
nbval: $(STAMP)
	$(if $(filter-out $(NBVAL_GENERIC),$(NOTEBOOKS)),$(WITH_NB_ENV) $(BIN)/pytest $(NBVAL_FLAGS) \
	  $(filter-out $(NBVAL_GENERIC),$(NOTEBOOKS)))
	$(if $(filter $(NBVAL_GENERIC),$(NOTEBOOKS)),ATEN_CPU_CAPABILITY=$(KERNELS) $(WITH_NB_ENV) \
	  $(BIN)/pytest $(NBVAL_FLAGS) $(filter $(NBVAL_GENERIC),$(NOTEBOOKS)))

nbval-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=$(KERNELS) $(WITH_NB_ENV) $(BIN)/pytest $(NBVAL_FLAGS) $(NOTEBOOKS)

# Does every chapter work here, GPUs included? Runs each chapter top to bottom (no Jupyter
# needed) and scripts/train_ddp.py under torchrun, on the PyTorch of .venv if there is one,
# else on $(PYTHON)'s (a GPU node's own). Report: runs/gpu_check/report.json.
# On a node without network: `make gpu-wheels` here, carry .whl/, GPU_CHECK_ARGS="--wheels .whl".
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_CHECK_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# The pure-Python packages the chapters import that a bare PyTorch image lacks (IPython,
# ipywidgets), as wheels for Python $(WHEELS_PYTHON) on x86-64 Linux, at the pinned versions.
WHEELS_PYTHON ?= 3.12
GPU_WHEELS := ipython ipython_pygments_lexers jedi parso matplotlib-inline pexpect ptyprocess \
  prompt_toolkit wcwidth stack-data executing asttokens pure_eval traitlets ipywidgets comm \
  widgetsnbextension jupyterlab_widgets tqdm cloudpickle
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version $(WHEELS_PYTHON) --implementation cp --platform manylinux2014_x86_64 \
	  -c $(PINS) -d .whl $(GPU_WHEELS)
	@du -sh .whl

# Re-execute every chapter in a fresh kernel, under the settings nbval uses, storing outputs
# and each chapter's run time (shown on the landing page and in its navigation line).
notebooks: $(STAMP)
	$(WITH_NB_ENV) $(BIN)/python tools/chapters.py execute $(NOTEBOOKS)
	$(BIN)/python tools/chapters.py nav notebooks

# Rewrite each chapter's navigation line (previous, next, helper modules used, run time).
nav: $(STAMP)
	$(BIN)/python tools/chapters.py nav notebooks

# Every benchmark, one after the other, into runs/bench/ (MGPU_BENCH_DIR=dir to change):
# benchmarks/results/ keeps the stored runs that the chapters check and the README quotes
# (see benchmarks/results_dir.py). bench-store renews those, on the reference machine, idle.
BENCH_SCRIPTS := $(filter-out benchmarks/results_dir.py,$(wildcard benchmarks/*.py))

bench: $(STAMP)
	@for script in $(BENCH_SCRIPTS); do echo "== $$script"; \
	  $(WITH_NB_ENV) $(BIN)/python $$script || exit 1; done
	@echo "results: $${MGPU_BENCH_DIR:-runs/bench}/ (the stored runs: benchmarks/results/)"

bench-store:
	@$(MAKE) --no-print-directory bench MGPU_BENCH_DIR=$(CURDIR)/benchmarks/results

# The README's pictures: plots drawn by the workbook's code, and JupyterLab screenshots
# taken by the browser test (which needs Chromium).
figures: $(STAMP)
	$(WITH_NB_ENV) $(BIN)/python scripts/readme_figures.py docs/images

screenshots: $(STAMP)
	MGPU_REQUIRE_BROWSER=1 MGPU_BROWSER_ALL=1 BROWSER_ARTIFACTS=docs/images \
	  $(BIN)/pytest tests/browser

# Rewrite the pins from what is installed in .venv (after changing a range in pyproject.toml).
pins:
	@test -x $(BIN)/python || { echo "error: no $(VENV); run 'make venv' first" >&2; exit 1; }
	{ sed -n '1,3p' $(PINS); $(BIN)/python -m pip freeze --exclude-editable | sort -f; } > $(PINS).new
	mv $(PINS).new $(PINS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
