# fuzz/fuzz.mk - libFuzzer harnesses and their replay drivers (included by the
# top Makefile, which defines BUILD, CC, ALLCFLAGS, OMPFLAGS, LIBS, STATIC, HDRS,
# DEPS_INC, DEPS_LIB).
#
#   $(BUILD)/fuzz/replay_<h>   gcc build of harness <h> + fuzz/replay.c: runs the corpus
#                              without libFuzzer (make check; also `make fuzz-replay`)
#   make fuzz                  clang libFuzzer+ASan+UBSan builds in build-fuzz/<h>
#   make fuzz-run FUZZ_TIME=180 FUZZ_JOBS=2
#                              every fuzzer for FUZZ_TIME s, FUZZ_JOBS at a time; new inputs in
#                              build-fuzz/corpus/<h>, crashes in fuzz/regressions/<h>/
#                              (FUZZ_ARTIFACTS); a harness passes when it ran its corpus and
#                              fuzzed on without a crash; ends with "N passed, N failed"
#                              (harnesses). .ci/run runs it with FUZZ_TIME=10.
#   make fuzz-corpus           merges build-fuzz/corpus/<h> into a minimized fuzz/corpus/<h>,
#                              at most FUZZ_CORPUS_MAX files (the largest are kept), plus the
#                              inputs named cpu-checked-* (make fuzz-cpu-seeds), kept as they are
#
# <h> is the harness file's base name: fuzz/fuzz_config.c -> fuzz_config.

FUZZ_HARNESSES := $(sort $(basename $(notdir $(filter-out fuzz/fuzz_common.c,$(wildcard fuzz/fuzz_*.c)))))
FUZZ_REPLAY_BIN := $(patsubst %,$(BUILD)/fuzz/replay_%,$(FUZZ_HARNESSES))
FUZZ_DEPS_SRC := fuzz/fuzz_common.c fuzz/replay.c $(wildcard fuzz/*.h)

# Arguments of replay_<h>: its corpus, and its regression inputs when there are any.
fuzz_replay_args = fuzz/corpus/$(1) $(wildcard fuzz/regressions/$(1))

.PHONY: fuzz fuzz-run fuzz-corpus fuzz-replay fuzz-deps fuzz-clean

# ---- replay drivers (the toolchain of the library build) ---------------------------
$(BUILD)/fuzz/replay_%: fuzz/%.c $(FUZZ_DEPS_SRC) $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -Ifuzz $< fuzz/fuzz_common.c fuzz/replay.c $(STATIC) $(LIBS) -o $@

# Inputs that check a cpu output (fuzz/seek_cpu.c), for a corpus whose replay reports none:
#   make fuzz-cpu-seeds FUZZ_HARNESS=fuzz_op_full_attention [FUZZ_SEEDS=4 FUZZ_SEED=1]
FUZZ_SEEDS ?= 4
FUZZ_SEED  ?= 1
.PHONY: fuzz-cpu-seeds
$(BUILD)/fuzz/seek_cpu_%: fuzz/%.c fuzz/seek_cpu.c $(FUZZ_DEPS_SRC) $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) -Ifuzz $< fuzz/fuzz_common.c fuzz/seek_cpu.c $(STATIC) $(LIBS) -o $@
fuzz-cpu-seeds: $(BUILD)/fuzz/seek_cpu_$(FUZZ_HARNESS)
	@[ -n "$(FUZZ_HARNESS)" ] || { echo "make fuzz-cpu-seeds: set FUZZ_HARNESS"; exit 1; }
	$(BUILD)/fuzz/seek_cpu_$(FUZZ_HARNESS) fuzz/corpus/$(FUZZ_HARNESS) $(FUZZ_SEEDS) $(FUZZ_SEED)

# The seed corpus of fuzz_load: small valid snapshots and mutations (fuzz/gen_load_seeds.c).
.PHONY: fuzz-load-seeds
$(BUILD)/fuzz/gen_load_seeds: fuzz/gen_load_seeds.c $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(ALLCFLAGS) $(OMPFLAGS) $< $(STATIC) $(LIBS) -o $@
fuzz-load-seeds: $(BUILD)/fuzz/gen_load_seeds
	@mkdir -p fuzz/corpus/fuzz_load
	$(BUILD)/fuzz/gen_load_seeds fuzz/corpus/fuzz_load

# Runs every replay driver on its corpus (what make check does); ends with the sums.
fuzz-replay: $(FUZZ_REPLAY_BIN)
	@pass=0; fail=0; \
	for h in $(FUZZ_HARNESSES); do \
	  regr=; [ -d fuzz/regressions/$$h ] && regr=fuzz/regressions/$$h; \
	  out=$$($(BUILD)/fuzz/replay_$$h fuzz/corpus/$$h $$regr 2>&1); rc=$$?; \
	  printf '%s\n' "$$out" | tail -n 2 | head -n 1; \
	  last=$$(printf '%s\n' "$$out" | tail -n 1); \
	  p=$$(printf '%s' "$$last" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$$/\1/p'); \
	  f=$$(printf '%s' "$$last" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$$/\2/p'); \
	  if [ $$rc -ne 0 ] || [ -z "$$p" ]; then echo "replay $$h: FAILED (rc $$rc)"; printf '%s\n' "$$out" | tail -n 20; \
	    f=$${f:-0}; [ $$f -gt 0 ] || f=1; fail=$$((fail + f)); pass=$$((pass + $${p:-0})); \
	  else pass=$$((pass + p)); fail=$$((fail + f)); fi; \
	done; \
	echo "$$pass passed, $$fail failed"; [ $$fail -eq 0 ]

# ---- libFuzzer builds (clang, ASan + UBSan, CPU backends only) -----------------------
FUZZ_CC     ?= clang
FUZZ_BUILD  ?= build-fuzz
FUZZ_TIME   ?= 180
FUZZ_JOBS   ?= 2
FUZZ_MAXLEN ?= 4096
FUZZ_CORPUS_MAX ?= 40
# where fuzz-run puts the inputs that crash a harness (CI: a scratch folder)
FUZZ_ARTIFACTS ?= fuzz/regressions
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=all
FUZZ_CFLAGS := -std=c99 -D_POSIX_C_SOURCE=200809L -g -O1 -fno-omit-frame-pointer -ffp-contract=off \
               -Iinclude -Ilib $(DEPS_INC) -fopenmp $(FUZZ_SAN)
FUZZ_LIBS   := $(DEPS_LIB) -llapacke -lopenblas -lm -fopenmp -lpthread -ldl
FUZZ_LIB_SRC := $(wildcard lib/*.c) $(wildcard ref/*.c) $(wildcard cpu/*.c)
FUZZ_LIB_OBJ := $(patsubst %.c,$(FUZZ_BUILD)/obj/%.o,$(FUZZ_LIB_SRC))
FUZZ_LIB     := $(FUZZ_BUILD)/libshadowkv-fuzz.a
FUZZ_BIN     := $(patsubst %,$(FUZZ_BUILD)/%,$(FUZZ_HARNESSES))
FUZZ_STAMP   := $(FUZZ_BUILD)/.deps-ok

# clang that can link a libFuzzer binary (clang + libclang-rt-14-dev); installed once.
fuzz-deps: $(FUZZ_STAMP)
$(FUZZ_STAMP): | $(DEPS_STAMP)
	@mkdir -p $(FUZZ_BUILD)
	@if printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n){return 0;}\n' | \
	    $(FUZZ_CC) -fsanitize=fuzzer,address,undefined -fopenmp -x c - -o $(FUZZ_BUILD)/.fuzzprobe >/dev/null 2>&1; \
	then :; else \
	  echo "make: installing clang libclang-rt-14-dev libomp-14-dev (apt-get)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq clang libclang-rt-14-dev libomp-14-dev >/dev/null || \
	  { echo "make: could not install clang libclang-rt-14-dev libomp-14-dev"; exit 1; }; \
	fi
	@rm -f $(FUZZ_BUILD)/.fuzzprobe
	@touch $@

$(FUZZ_BUILD)/obj/cpu/%.o: cpu/%.c $(HDRS) | $(FUZZ_STAMP)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_BUILD)/obj/%.o: %.c $(HDRS) | $(FUZZ_STAMP)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_LIB): $(FUZZ_LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(FUZZ_BUILD)/fuzz_%: fuzz/fuzz_%.c $(FUZZ_DEPS_SRC) $(FUZZ_LIB) | $(FUZZ_STAMP)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -Ifuzz $< fuzz/fuzz_common.c $(FUZZ_LIB) $(FUZZ_LIBS) -o $@

fuzz: $(FUZZ_BIN)

# One fuzzer: $1 = harness. OpenMP/OpenBLAS pinned to one thread each so FUZZ_JOBS
# fuzzers use about FUZZ_JOBS cores (a harness may still ask for 2 via n_threads).
FUZZ_ENV := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
            UBSAN_OPTIONS=print_stacktrace=1

fuzz-run: $(FUZZ_BIN)
	@mkdir -p $(FUZZ_BUILD)/corpus
	@printf '%s\n' $(FUZZ_HARNESSES) | xargs -P $(FUZZ_JOBS) -I{} sh -c '\
	  h={}; mkdir -p $(FUZZ_BUILD)/corpus/$$h fuzz/corpus/$$h $(FUZZ_ARTIFACTS)/$$h; \
	  echo "fuzz-run: $$h for $(FUZZ_TIME) s"; \
	  $(FUZZ_ENV) $(FUZZ_BUILD)/$$h -max_total_time=$(FUZZ_TIME) -max_len=$(FUZZ_MAXLEN) -timeout=10 \
	    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=$(FUZZ_ARTIFACTS)/$$h/ \
	    $(FUZZ_BUILD)/corpus/$$h fuzz/corpus/$$h > $(FUZZ_BUILD)/$$h.log 2>&1; rc=$$?; echo $$rc > $(FUZZ_BUILD)/$$h.rc; \
	  [ $$rc -eq 0 ] || echo "fuzz-run: $$h FAILED (see $(FUZZ_BUILD)/$$h.log, inputs in $(FUZZ_ARTIFACTS)/$$h/)"; \
	  rmdir $(FUZZ_ARTIFACTS)/$$h 2>/dev/null; true'
	@bad=0; for h in $(FUZZ_HARNESSES); do \
	  log=$(FUZZ_BUILD)/$$h.log; rc=$$(cat $(FUZZ_BUILD)/$$h.rc 2>/dev/null || echo 1); \
	  line=$$(grep -E '^#[0-9]+' $$log | tail -n 1); \
	  execs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $$log | tail -n 1); \
	  [ -n "$$execs" ] || execs=$$(printf '%s' "$$line" | sed -n 's/^#\([0-9]*\).*/\1/p'); \
	  cov=$$(printf '%s' "$$line" | sed -n 's/.*cov: \([0-9]*\).*/\1/p'); \
	  ft=$$(printf '%s' "$$line" | sed -n 's/.*ft: \([0-9]*\).*/\1/p'); \
	  crash=; if grep -qE '^(==[0-9]+==ERROR|SUMMARY: |fuzz invariant violated|.*deadly signal)' $$log; then crash=" CRASH"; \
	  elif [ "$$rc" != 0 ]; then crash=" FAILED (exit $$rc)"; \
	  elif ! grep -qE '^#[0-9]+[[:space:]]+INITED' $$log || ! grep -qE '^Done [0-9]+ runs' $$log; then \
	    crash=" FAILED (did not get past its corpus)"; fi; \
	  [ -z "$$crash" ] || bad=$$((bad + 1)); \
	  printf '%-28s execs %10s  cov %6s  ft %7s%s\n' $$h "$${execs:-?}" "$${cov:-?}" "$${ft:-?}" "$$crash"; \
	done; \
	echo "fuzz-run: every harness for $(FUZZ_TIME) s past its corpus"; \
	echo "$$(( $(words $(FUZZ_HARNESSES)) - bad )) passed, $$bad failed"; [ $$bad -eq 0 ]

# Minimizes the union of the committed seeds and what fuzz-run found into fuzz/corpus/<h>;
# the cpu-checked-* inputs stay (a merge keeps coverage, and checking cpu adds none).
fuzz-corpus: $(FUZZ_BIN)
	@for h in $(FUZZ_HARNESSES); do \
	  rm -rf $(FUZZ_BUILD)/merge/$$h; mkdir -p $(FUZZ_BUILD)/merge/$$h $(FUZZ_BUILD)/corpus/$$h fuzz/corpus/$$h; \
	  $(FUZZ_ENV) $(FUZZ_BUILD)/$$h -merge=1 -max_len=$(FUZZ_MAXLEN) -timeout=10 -rss_limit_mb=2048 \
	    $(FUZZ_BUILD)/merge/$$h fuzz/corpus/$$h $(FUZZ_BUILD)/corpus/$$h > $(FUZZ_BUILD)/$$h.merge.log 2>&1 || \
	    { echo "fuzz-corpus: merge of $$h failed (see $(FUZZ_BUILD)/$$h.merge.log)"; exit 1; }; \
	  rm -rf $(FUZZ_BUILD)/keep/$$h; mkdir -p $(FUZZ_BUILD)/keep/$$h; \
	  cp fuzz/corpus/$$h/cpu-checked-* $(FUZZ_BUILD)/keep/$$h/ 2>/dev/null; \
	  rm -rf fuzz/corpus/$$h && cp -r $(FUZZ_BUILD)/merge/$$h fuzz/corpus/$$h; \
	  (cd fuzz/corpus/$$h && ls -S | tail -n +$$(($(FUZZ_CORPUS_MAX) + 1)) | xargs -r rm -f); \
	  cp $(FUZZ_BUILD)/keep/$$h/* fuzz/corpus/$$h/ 2>/dev/null; \
	  echo "fuzz-corpus: $$h: $$(ls fuzz/corpus/$$h | wc -l) files"; \
	done

fuzz-clean:
	rm -rf $(FUZZ_BUILD) $(BUILD)/fuzz
