# make run: the main job (the watchdog supervising the embedded PPO trainer).
# make run-verl: the watchdog supervising an unmodified verl (python -m verl.trainer.main_ppo) on CPU.
# make test: everything CI runs. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run run-verl test lint bench clean deps constraints versions package-tree

# The tested set of versions: every package of the test environment pinned, so a release of any
# dependency cannot turn `make test` red by surprise. pyproject.toml keeps ranges (a user's
# environment is not pinned); `make constraints` re-resolves them today, on purpose.
CONSTRAINTS := constraints.txt
EXTRAS := trainer,verl,ray,trl,test

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build on this machine's disk, not a multi-GB CUDA build.
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	# The watchdog and every extra: the embedded trainer, the in-process verl glue, Ray, the tests.
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	touch $(STAMP)

# Refresh constraints.txt: resolve pyproject.toml's ranges afresh in a throwaway venv and pin the result.
constraints:
	rm -rf .venv-resolve && $(PY) -m venv .venv-resolve
	.venv-resolve/bin/pip install -q --upgrade pip
	.venv-resolve/bin/pip install -q torch==2.13.0
	.venv-resolve/bin/pip install -q '.[$(EXTRAS)]'
	{ echo "# The tested set: written by \`make constraints\` on $$(date -u +%F); pyproject.toml keeps ranges."; \
	  .venv-resolve/bin/pip freeze --exclude-editable | grep -v '^ppo-watchdog' | sed 's/+cpu$$//'; } > $(CONSTRAINTS)
	rm -rf .venv-resolve
	@echo "constraints.txt refreshed; run make test before committing it"

# What the test environment resolved to (printed by .ci/run before the tests).
versions: $(STAMP)
	@$(BIN)/python -c "from importlib.metadata import version as v; \
	  print('resolved:', ', '.join(f'{p} {v(p)}' for p in ('torch', 'verl', 'ray', 'transformers', 'trl', 'prometheus-client')))"

deps:
	@command -v promtool >/dev/null 2>&1 && command -v amtool >/dev/null 2>&1 || { \
	  echo "installing Debian's prometheus (promtool + server for the integration tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium (headless: the report test renders report.html in it)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The seed's settings scaled to CPU, with a fault schedule that produces the table's
# failures: a KL excursion (kl_coef collapse + lr spike), an OOM, and a divergence (30x lr).
# Nobody sits at the keyboard of a demo: a run the watchdog can do nothing more for ends with
# a verdict (--on-escalate stop) instead of waiting for `watchdog resume`. RUN_ARGS adds options
# (tests/test_demo.py passes its own run and state directories).
DEMO := --faults "kl_collapse@8:0.1,lr_spike@8:x3,oom@30,lr_spike@59:x30" --on-escalate stop \
  --set algorithm.kl_ctrl.kl_coef=0.001 --set data.train_size=128 --set trainer.total_training_steps=80
run: $(STAMP)
	$(BIN)/watchdog run $(DEMO) $(RUN_ARGS)

# verl's own PPO trainer (GAE, critic, KL in the reward) on CPU through trainer/verl_cpu's plugin, under
# `watchdog run --mode verl`, with injected faults: a NaN loss (rollback), an OOM budget (smaller micro
# batch), and the demo overlay's tuning set (lr by relaunch). Tiny local assets, no hub. 5-8 min on
# 2 cores. RUN_VERL_ARGS adds options (e.g. --run-dir DIR).
VERL_ASSETS := .verl_cpu_assets
$(VERL_ASSETS)/.built: $(STAMP) trainer/verl_cpu/assets.py
	$(BIN)/python -m ppo_watchdog.trainer.verl_cpu.assets $(VERL_ASSETS)
	touch $@
run-verl: $(STAMP) $(VERL_ASSETS)/.built
	$(BIN)/python -m ppo_watchdog.trainer.verl_cpu.demo --assets $(VERL_ASSETS) $(RUN_VERL_ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist): a test file goes whole to one worker, the files
# that start Ray to the same one (tests/conftest.py). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP) deps package-tree
	PYTHONPATH=$(PACKAGE_TREE) $(BIN)/lint-imports
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# import-linter and mypy read a package from its folder, and ppo_watchdog is mapped from two (watchdog/ and
# trainer/, pyproject's package-dir): they check a copy laid out as the package installs.
PACKAGE_TREE := $(VENV)/package-tree
package-tree:
	rm -rf $(PACKAGE_TREE) && mkdir -p $(PACKAGE_TREE)
	cp -r watchdog $(PACKAGE_TREE)/ppo_watchdog && cp -r trainer $(PACKAGE_TREE)/ppo_watchdog/trainer

lint: $(STAMP) package-tree
	$(BIN)/ruff check trainer watchdog tests bench
	cd $(PACKAGE_TREE) && $(abspath $(BIN))/mypy --config-file $(CURDIR)/pyproject.toml -p ppo_watchdog

bench: $(STAMP)
	$(BIN)/python bench/bench_rules.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info $(VERL_ASSETS)
