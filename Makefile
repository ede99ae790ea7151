# libshadowkv build.
#   make            build/libshadowkv.a, build/libshadowkv.so, tools
#   make demo       install missing packages, build and run the demo (the main job)
#   make check      install missing packages, build and run every test
#   make bench      build/skv-bench
#   make install PREFIX=/usr/local
#
# The exact-selection contract (DESIGN.md section 5) needs IEEE arithmetic in
# source order: -ffp-contract=off everywhere, and no fast-math flag of any kind.

CC      ?= gcc
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

# ---- CUDA backend: compiled in when nvcc is found (SKV_CUDA=0 forces a CPU-only build) ----
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
SKV_CUDA ?= $(if $(NVCC),1,0)
ifeq ($(SKV_CUDA),1)
CUDA_HOME  ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
# sm_90 machine code for Hopper, plus compute_90 PTX so newer GPUs can JIT it
NVCC_ARCH  ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
NVCCFLAGS  := -std=c++17 -O3 -g $(NVCC_ARCH) -Xcompiler -fPIC,-fvisibility=hidden,-Wall \
              -Iinclude -Ilib -Icuda $(NVCCFLAGS_EXTRA)
# the decision path (selection, landmarks, RoPE) must not be contracted behind our back
NVCC_EXACT := --fmad=false
CU_SRC     := $(wildcard cuda/*.cu)
CU_OBJ     := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CU_SRC))
C_CUDA_SRC :=
CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcusolver -lcublas -lcudart -lstdc++ -ldl -lrt
TEST_CUDA_FLAGS := -DSKV_HAVE_CUDA -I$(CUDA_HOME)/include
else
TEST_CUDA_FLAGS :=
CU_OBJ     :=
C_CUDA_SRC := cuda/skv_cuda_stub.c
CUDA_LIBS  :=
endif
LIBS     += $(CUDA_LIBS)

LIB_SRC  := $(wildcard lib/*.c) $(wildcard ref/*.c) $(wildcard cpu/*.c) $(C_CUDA_SRC)
LIB_OBJ  := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRC)) $(CU_OBJ)
HDRS     := $(wildcard include/*.h) $(wildcard lib/*.h) $(wildcard ref/*.h) $(wildcard cpu/*.h) \
            $(wildcard cuda/*.h) $(wildcard cuda/*.cuh)

COMMON_SRC := $(wildcard tests/common/*.c)
COMMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(COMMON_SRC))
COMMON_HDR := $(wildcard tests/common/*.h)
TEST_SRC   := $(wildcard tests/*.c)
TEST_BIN   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))

STATIC := $(BUILD)/libshadowkv.a
SHARED := $(BUILD)/libshadowkv.so
DEPS_STAMP := $(BUILD)/.deps-ok

# fuzz harnesses: corpus replays (run by make check), libFuzzer builds (make fuzz)
-include fuzz/fuzz.mk

.PHONY: all lib demo check bench tests install uninstall clean deps link-check asan-check

all: lib $(BUILD)/demo $(BUILD)/skv-bench $(TEST_BIN)
lib: $(STATIC) $(SHARED)

# ---- system packages (a fresh Debian machine has none of these) -------------
# Installs what is missing through apt-get, once; a no-op when present.
deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@mkdir -p $(BUILD)
	@if printf '#include <cblas.h>\n#include <lapacke.h>\nint main(void){return 0;}\n' | \
	    $(CC) $(DEPS_INC) -x c - -o $(BUILD)/.depprobe $(DEPS_LIB) -llapacke -lopenblas -fopenmp >/dev/null 2>&1 && \
	    { command -v pkg-config >/dev/null 2>&1 || [ -n "$(SKV_DEPS)" ]; }; then :; else \
	  echo "make: installing libopenblas-dev liblapacke-dev pkg-config (apt-get)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libopenblas-dev liblapacke-dev pkg-config >/dev/null || \
	  { echo "make: could not install libopenblas-dev liblapacke-dev pkg-config"; exit 1; }; \
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

$(BUILD)/obj/cuda/skv_cuda_select.o: cuda/skv_cuda_select.cu $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(NVCC_EXACT) -c $< -o $@

$(BUILD)/obj/cuda/%.o: cuda/%.cu $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(STATIC): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SHARED): $(LIB_OBJ)
	$(CC) -shared -o $@ $^ -Wl,-soname,libshadowkv.so.0 $(LIBS)

# ---- tests, demo, bench (linked statically against the library) -------------
$(BUILD)/obj/tests/common/%.o: tests/common/%.c $(COMMON_HDR) include/shadowkv.h | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -Itests/common -c $< -o $@

$(BUILD)/tests/%: tests/%.c $(COMMON_OBJ) $(COMMON_HDR) $(STATIC) lib/skv_numerics.h
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) $(TEST_CUDA_FLAGS) -Itests/common $< $(COMMON_OBJ) $(STATIC) $(LIBS) $(TEST_LDFLAGS) -o $@

# allocation-failure injection: the library's heap calls go through the test's wrappers
$(BUILD)/tests/test_alloc_fail: TEST_LDFLAGS = -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=free,--wrap=posix_memalign

$(BUILD)/demo: examples/demo.c $(COMMON_OBJ) $(COMMON_HDR) $(STATIC)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -Itests/common $< $(COMMON_OBJ) $(STATIC) $(LIBS) -o $@

# TEST_CUDA_FLAGS: skv-bench factorize's cuSOLVER gesvd baseline (CUDA builds only)
$(BUILD)/skv-bench: $(wildcard bench/*.c) $(COMMON_OBJ) $(COMMON_HDR) $(STATIC)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) $(TEST_CUDA_FLAGS) -Itests/common $(wildcard bench/*.c) $(COMMON_OBJ) $(STATIC) $(LIBS) -o $@

tests: $(TEST_BIN)
bench: $(BUILD)/skv-bench

demo: $(BUILD)/demo
	./$(BUILD)/demo $(DEMO_ARGS)

# make check: every test binary, the fuzz corpus replays, the binaries that run
# the cpu backend once more with SKV_CPU_SIMD=0 (its portable code: a CPU
# without AVX2+FMA, or another architecture), then the install + pkg-config
# link check; ends with the summed "N passed, N failed, N skipped".
CPU_PORTABLE_BIN := $(filter-out %/test_numerics %/test_cuda,$(TEST_BIN))
check: $(TEST_BIN) $(BUILD)/demo $(BUILD)/skv-bench $(FUZZ_REPLAY_BIN)
	@FUZZ_REPLAY="$(FUZZ_REPLAY_BIN)" CPU_PORTABLE="$(CPU_PORTABLE_BIN)" bash tests/run_all.sh $(TEST_BIN)

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

# Installs into a staging prefix and builds examples/link_example.c with
# pkg-config only, then runs it.
link-check: lib
	@rm -rf $(BUILD)/stage
	@$(MAKE) --no-print-directory install PREFIX=$(CURDIR)/$(BUILD)/stage >/dev/null
	@echo "== link_example (installed copy, pkg-config)"
	@PKG_CONFIG_PATH=$(CURDIR)/$(BUILD)/stage/lib/pkgconfig; export PKG_CONFIG_PATH; \
	  $(CC) -std=c99 -Wall -Wextra -o $(BUILD)/link_example examples/link_example.c \
	    $$(pkg-config --cflags --libs shadowkv) && \
	  LD_LIBRARY_PATH=$(CURDIR)/$(BUILD)/stage/lib ./$(BUILD)/link_example && \
	  $(CC) -std=c99 -Wall -Wextra -o $(BUILD)/link_example_static examples/link_example.c \
	    $$(pkg-config --cflags shadowkv) $(CURDIR)/$(BUILD)/stage/lib/libshadowkv.a \
	    $$(pkg-config --libs --static shadowkv | sed 's/-lshadowkv//') && \
	  ./$(BUILD)/link_example_static

install: lib
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 include/shadowkv.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(STATIC) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(SHARED) $(DESTDIR)$(PREFIX)/lib/libshadowkv.so.0
	ln -sf libshadowkv.so.0 $(DESTDIR)$(PREFIX)/lib/libshadowkv.so
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|0.1.0|' -e 's|@CUDA_LIBS@|$(CUDA_LIBS)|' shadowkv.pc.in \
	  > $(DESTDIR)$(PREFIX)/lib/pkgconfig/shadowkv.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/shadowkv.h $(DESTDIR)$(PREFIX)/lib/libshadowkv.a \
	  $(DESTDIR)$(PREFIX)/lib/libshadowkv.so $(DESTDIR)$(PREFIX)/lib/libshadowkv.so.0 \
	  $(DESTDIR)$(PREFIX)/lib/pkgconfig/shadowkv.pc

clean:
	rm -rf $(BUILD) build-asan build-fuzz
