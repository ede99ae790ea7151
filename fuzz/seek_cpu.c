/*
 * seek_cpu.c - finds inputs on which a harness compares an output with an oracle on the cpu
 * backend (skvf_note_checked), for a corpus that lacks them (the replay driver fails then):
 *   seek_cpu_<harness> OUTDIR [COUNT [SEED]]
 * Runs pseudo-random inputs (64..4096 bytes, from SEED) through the harness and writes the
 * first COUNT (default 4) that checked a cpu output to OUTDIR/cpu-checked-<seed>-<i>. The
 * merge of make fuzz-corpus keeps files named cpu-checked-* (libFuzzer keeps what adds
 * coverage, and checking cpu adds none over checking ref). Prints what it wrote.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern long skvf_checked[2]; /* fuzz_common.c */

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s OUTDIR [COUNT [SEED]]\n", argv[0]);
        return 2;
    }
    const long want = argc > 2 ? atol(argv[2]) : 4;
    uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 1, x = seed * 0x9E3779B97F4A7C15ull + 1;
    static uint8_t buf[4096];
    long found = 0;
    for (long tries = 0; tries < 200000 && found < want; tries++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const size_t n = 64 + (size_t)(x % (sizeof buf - 63));
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i] = (uint8_t)(x >> 32);
        }
        const long before = skvf_checked[1];
        LLVMFuzzerTestOneInput(buf, n);
        if (skvf_checked[1] == before) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/cpu-checked-%llu-%ld", argv[1], (unsigned long long)seed, found);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(buf, 1, n, f) != n || fclose(f) != 0) {
            fprintf(stderr, "seek_cpu: cannot write %s\n", path);
            return 1;
        }
        printf("seek_cpu: %s (%zu bytes, try %ld)\n", path, n, tries + 1);
        found++;
    }
    if (found < want) fprintf(stderr, "seek_cpu: found %ld of %ld inputs\n", found, want);
    return found == want ? 0 : 1;
}
