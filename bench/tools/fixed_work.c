/*
 * fixed_work.c - the floor of bench/busy_prefill.sh's ratio on this machine:
 * a fixed amount of pure CPU work (dependent multiply-adds, no memory traffic,
 * no waiting but the final join), split over 1 thread and over 2 threads, each
 * timed idle and beside --busy loops, --rounds times.
 *
 *   make build/fixed_work
 *   build/fixed_work [--busy 2] [--rounds 3] [--ms 1000]
 *
 * The loops are forked children spinning in the same session, like
 * bench/busy_decode.sh's `sh -c 'while :; do :; done'`; each starts 0.5 s
 * before the timed run and is killed after it. --ms sets the one-thread idle
 * time (calibrated once). A prefill is a mix of serial work (the 1-thread
 * ratio) and parallel work (the 2-thread ratio); a fair scheduler bounds its
 * busy/idle ratio below by the smaller of the two, whatever the library does.
 * Prints one line per round and the medians; exit status 0, 2 on bad options.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void *work(void *arg)
{
    long n = *(const long *)arg;
    volatile double x = 1.0;
    for (long i = 0; i < n; i++) x = x * 1.0000001 + 1e-9;
    return NULL;
}

/* wall ms of total iterations split over t threads (the caller is one of them) */
static double run(long total, int t)
{
    long part = total / t;
    pthread_t th;
    double t0 = now_ms();
    if (t > 1 && pthread_create(&th, NULL, work, &part)) t = 1, part = total;
    work(&part);
    if (t > 1) pthread_join(th, NULL);
    return now_ms() - t0;
}

static double timed(long total, int t, int busy)
{
    pid_t kid[64];
    int nk = 0;
    for (int i = 0; i < busy && i < 64; i++) {
        pid_t p = fork();
        if (p == 0)
            for (;;) {
            }
        if (p > 0) kid[nk++] = p;
    }
    if (nk) nanosleep(&(struct timespec){0, 500000000}, NULL);
    double ms = run(total, t);
    for (int i = 0; i < nk; i++) kill(kid[i], SIGKILL), waitpid(kid[i], NULL, 0);
    return ms;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
    int busy = 2, rounds = 3;
    double target = 1000;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--busy")) busy = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--rounds")) rounds = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--ms")) target = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: fixed_work [--busy 2] [--rounds 3] [--ms 1000]\n");
            return 2;
        }
    }
    if (busy < 0 || busy > 64 || rounds < 1 || rounds > 99 || target < 10) {
        fprintf(stderr, "fixed_work: --busy 0..64, --rounds 1..99, --ms >= 10\n");
        return 2;
    }
    long total = 1000000;
    double ms;
    while ((ms = run(total, 1)) < 200) total *= 2; /* calibration, at least 0.2 s */
    total = (long)(total * target / ms);
    printf("fixed_work: %ld dependent multiply-adds (about %.0f ms on one idle thread); %d busy loops; %d rounds\n",
           total, target, busy, rounds);
    for (int t = 1; t <= 2; t++) {
        double idle[99], bz[99];
        for (int r = 0; r < rounds; r++) {
            idle[r] = timed(total, t, 0);
            bz[r] = timed(total, t, busy);
            printf("%d thread%s round %d: idle %.1f ms, busy %.1f ms\n", t, t > 1 ? "s" : "", r + 1, idle[r], bz[r]);
        }
        double mi = median(idle, rounds), mb = median(bz, rounds);
        printf("%d thread%s: idle median %.1f ms, busy median %.1f ms, ratio %.2f\n", t, t > 1 ? "s" : "", mi, mb,
               mb / mi);
    }
    return 0;
}
