/*
 * replay.c - runs a harness without libFuzzer (the regression driver):
 *   replay_<harness> PATH...
 * Each PATH is a file or a directory (read recursively, files sorted by name so
 * runs are deterministic). Every file's bytes go through LLVMFuzzerTestOneInput
 * once, after the empty input and a few fixed synthetic inputs (so an empty
 * corpus still exercises the harness). A violated invariant aborts (the
 * harness calls skvf_fail). A missing PATH fails the whole run before anything
 * runs ("0 passed, 1 failed"); an unreadable file counts as one failure.
 * A harness that compares outputs with an oracle (skvf_note_checked) must do so on cpu
 * for at least one input, else the run fails.
 * Last line: "N passed, F failed" (parsed by make check).
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern long skvf_checked[2]; /* fuzz_common.c */

#define MAX_INPUT (1u << 20) /* corpus files are <= 4096 bytes; anything larger is cut */

static long n_passed, n_failed;

static void run_one(const uint8_t *data, size_t size)
{
    /* a private copy of exactly size bytes, so ASan sees reads past the end */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) {
        fprintf(stderr, "replay: out of memory\n");
        exit(1);
    }
    if (size) memcpy(copy, data, size);
    LLVMFuzzerTestOneInput(copy, size);
    free(copy);
    n_passed++;
}

static void run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        n_failed++;
        return;
    }
    uint8_t *buf = malloc(MAX_INPUT);
    if (!buf) {
        fprintf(stderr, "replay: out of memory\n");
        exit(1);
    }
    size_t n = fread(buf, 1, MAX_INPUT, f);
    int err = ferror(f);
    fclose(f);
    if (err) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        n_failed++;
        return;
    }
    run_one(buf, n);
    free(buf);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void run_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        n_failed++;
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        run_file(path);
        return;
    }
    DIR *dir = opendir(path);
    if (!dir) {
        fprintf(stderr, "replay: cannot open directory %s: %s\n", path, strerror(errno));
        n_failed++;
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        if (e->d_name[0] == '.') continue; /* ".", "..", hidden files (.gitkeep) */
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, cap * sizeof *names);
            if (!names) exit(1);
        }
        size_t len = strlen(path) + strlen(e->d_name) + 2;
        names[n] = malloc(len);
        if (!names[n]) exit(1);
        snprintf(names[n], len, "%s/%s", path, e->d_name);
        n++;
    }
    closedir(dir);
    if (n) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
        run_path(names[i]);
        free(names[i]);
    }
    free(names);
}

/* The harness name: argv[0]'s base name without "replay_". */
static const char *harness_name(const char *argv0)
{
    const char *b = strrchr(argv0, '/');
    b = b ? b + 1 : argv0;
    return strncmp(b, "replay_", 7) == 0 ? b + 7 : b;
}

int main(int argc, char **argv)
{
    const char *name = harness_name(argc > 0 ? argv[0] : "replay");
    /* every path must exist: a missing corpus directory is a failure, not an empty pass */
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay %s: %s: %s\n", name, argv[i], strerror(errno));
            printf("replay %s: missing %s\n", name, argv[i]);
            printf("0 passed, 1 failed\n");
            return 1;
        }
    }
    /* fixed inputs: empty, all-zero, all-0xFF, a byte ramp and a short pseudo-random
       stream (the harness's carving decides what each becomes) */
    static uint8_t synth[1024];
    run_one(synth, 0);
    run_one(synth, 64);
    memset(synth, 0xFF, sizeof synth);
    run_one(synth, 256);
    for (size_t i = 0; i < sizeof synth; i++) synth[i] = (uint8_t)i;
    run_one(synth, sizeof synth);
    uint32_t x = 0x12345678u;
    for (size_t i = 0; i < sizeof synth; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        synth[i] = (uint8_t)(x >> 24);
    }
    run_one(synth, sizeof synth);
    run_one(synth, 97);
    long n_synth = n_passed;
    for (int i = 1; i < argc; i++) run_path(argv[i]);
    printf("replay %s: %ld inputs (%ld synthetic, %ld from files)\n", name, n_passed, n_synth,
           n_passed - n_synth);
    if (skvf_checked[0] + skvf_checked[1] > 0) {
        printf("replay %s: outputs checked against an oracle: %ld on ref, %ld on cpu\n", name, skvf_checked[0],
               skvf_checked[1]);
        if (skvf_checked[1] == 0) {
            printf("replay %s: FAILED: no input checks an output on cpu (add some to fuzz/corpus/%s)\n", name,
                   name);
            n_failed++;
        }
    }
    printf("%ld passed, %ld failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
