# Every target but `install` runs inside .venv. Usage: make TARGET CONFIG=configs/x.yaml ARGS="key=value ..."
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/base.yaml
ARGS ?=
# torch is installed first and pinned, so resolving the other dependencies never pulls another build.
# Elsewhere, choose a build with e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
TB_PORT ?= 6006

.PHONY: install check test prep train eval summarize overfit smoke bench tensorboard clean help compare average seeds report

help:
	@echo "make install | check | test | prep | train | eval | summarize | overfit | smoke | bench | tensorboard | clean"
	@echo "  CONFIG=$(CONFIG)  ARGS='key.sub=value ...'"
	@echo "make compare A=PRED_A B=PRED_B REF=PAIRS_OR_SPLIT [OUT=DIR] [ARGS='--truncate-bytes N ...'] | average [N=all kept] | seeds N=3 | report [DIRS='dir ...'] [CSV=1]"

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import torch, sentencepiece, datasets, rouge_score, tensorboard; v = torch.__version__.split('+')[0]; \
	assert v == '$(TORCH_VERSION)', f'torch {v} in $(VENV), not $(TORCH_VERSION): remove $(VENV) and run make install'; \
	print('installed torch', torch.__version__)"
	touch $@

# Lint (ruff.toml): pyflakes, pycodestyle, import order, bugbear, pyupgrade.
check: install
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collected no test: that must fail, never pass silently.
test: install
	$(PY) -m pytest -q; rc=$$?; [ $$rc -ne 5 ] || echo "error: no tests were collected"; exit $$rc

prep: install
	$(PY) -m data_prep --config $(CONFIG) $(ARGS)

# train and eval depend on the prepared data as Make targets do on their inputs: a missing data.dir is
# prepared from data.source first. An existing one is used as it is (a note says where its data settings differ),
# unless ARGS give a data.* key another value than it was prepared with: refused, as `make prep` refuses it.
train: install
	$(PY) -m data_prep --if-missing --config $(CONFIG) $(ARGS)
	$(PY) -m summarizer train --config $(CONFIG) $(ARGS)

eval: install
	$(PY) -m data_prep --if-missing --config $(CONFIG) $(ARGS)
	$(PY) -m summarizer eval --config $(CONFIG) $(ARGS)

summarize: install
	$(PY) -m summarizer summarize --config $(CONFIG) $(ARGS)

bench: install
	$(PY) -m summarizer bench --config $(CONFIG) $(ARGS)

# the overfit check's own config unless CONFIG is given
OVERFIT_CONFIG = $(if $(filter command line environment,$(origin CONFIG)),$(CONFIG),configs/overfit.yaml)
overfit: install
	$(PY) -m data_prep --config $(OVERFIT_CONFIG) $(ARGS)
	$(PY) -m summarizer overfit --config $(OVERFIT_CONFIG) $(ARGS)

smoke: install
	$(PY) -m data_prep --config configs/tiny.yaml $(ARGS)
	$(PY) -m summarizer train --config configs/tiny.yaml $(ARGS)
	$(PY) -m summarizer eval --config configs/tiny.yaml $(ARGS)
	head -n 3 tests/assets/tiny/test.jsonl | $(PY) -c "import json,sys; [print(json.loads(l)['source']) for l in sys.stdin]" \
		| $(PY) -m summarizer summarize --config configs/tiny.yaml $(ARGS)

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs --port $(TB_PORT)

# Only directories the product made (its marker file inside), never through a symbolic link: a user's own
# directory or link under checkpoints/ or runs/ stays, and so does what a link points to.
clean:
	@for d in runs/* checkpoints/* data/tiny data/overfit; do \
		if [ -d "$$d" ] && [ ! -L "$$d" ] && { [ -f "$$d/.summarizer" ] || [ -f "$$d/.summarizer.run_dir" ]; }; then \
			rm -rf "$$d" && echo "removed $$d"; \
		elif [ -d "$$d" ] || [ -L "$$d" ]; then echo "kept $$d (not made by this product)"; fi; \
	done; rmdir runs 2>/dev/null; rm -rf .pytest_cache

# The research harness (docs/comparing.md).
compare: install
	@test -n "$(A)" -a -n "$(B)" -a -n "$(REF)" || { echo "error: usage: make compare A=PRED_A B=PRED_B REF=PAIRS_OR_SPLIT [OUT=DIR] [ARGS='--truncate-bytes N --samples N --seed S']" >&2; exit 2; }
	$(PY) -m summarizer compare $(A) $(B) --ref $(REF) --out $(or $(OUT),.) $(ARGS)

average: install
	$(PY) -m summarizer average --config $(CONFIG) $(if $(N),--last $(N)) $(ARGS)

seeds: install
	$(PY) -m summarizer seeds --config $(CONFIG) --n $(or $(N),3) $(ARGS)

# CSV=1 writes CSV; CSV=0 (or false, no), like no CSV at all, the Markdown table.
report: install
	$(PY) -m summarizer report $(DIRS) $(if $(filter-out 0 false no,$(CSV)),--csv)
