/* sampler.c: records MemAvailable about every millisecond for the reaction benchmark.
 *
 * Reads /proc/meminfo (pread on one open fd) every --interval-us (default 1000) and, if --status
 * names the hog's status file, the hog's held bytes. Keeps samples in memory and writes them as
 * CSV (t_ns,avail_kib,hog_bytes; t_ns on CLOCK_MONOTONIC) to --out when it gets SIGTERM/SIGINT
 * or after --max-s seconds. Touches its sample buffer up front so that it does not allocate while
 * memory is short.
 *
 * Build: gcc -O2 -Wall -o sampler sampler.c
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct hog_status {
    volatile uint64_t held_bytes;
    volatile int64_t last_growth_ns;
    volatile int64_t start_ns;
    volatile int32_t capped;
    volatile int32_t pid;
};
struct sample { int64_t t; int64_t avail_kib; uint64_t hog; };

static volatile sig_atomic_t stop;
static void on_signal(int s) { (void)s; stop = 1; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int64_t mem_available_kib(int fd) {
    char buf[4096];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strstr(buf, "MemAvailable:");
    return p ? strtoll(p + 13, NULL, 10) : -1;
}

int main(int argc, char **argv) {
    const char *out = NULL, *status_path = NULL;
    long interval_us = 1000;
    double max_s = 120;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--status") && i + 1 < argc) status_path = argv[++i];
        else if (!strcmp(argv[i], "--interval-us") && i + 1 < argc) interval_us = atol(argv[++i]);
        else if (!strcmp(argv[i], "--max-s") && i + 1 < argc) max_s = atof(argv[++i]);
        else { fprintf(stderr, "usage: %s --out CSV [--status FILE] [--interval-us N] [--max-s S]\n", argv[0]); return 2; }
    }
    if (!out) { fprintf(stderr, "sampler: --out is required\n"); return 2; }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    size_t cap = (size_t)(max_s * 1e6 / interval_us) + 16;
    struct sample *s = malloc(cap * sizeof *s);
    if (!s) return 1;
    memset(s, 0, cap * sizeof *s);
    mlockall(MCL_CURRENT); /* best effort: do not page the sampler out under pressure */
    int fd = open("/proc/meminfo", O_RDONLY);
    if (fd < 0) { perror("sampler: /proc/meminfo"); return 1; }
    struct hog_status *st = NULL;
    size_t n = 0;
    int64_t t0 = now_ns(), next = t0;
    while (!stop && n < cap && now_ns() - t0 < (int64_t)(max_s * 1e9)) {
        if (!st && status_path) {
            int sfd = open(status_path, O_RDONLY);
            struct stat sb;
            if (sfd >= 0 && fstat(sfd, &sb) == 0 && sb.st_size >= 4096) {
                void *m = mmap(NULL, 4096, PROT_READ, MAP_SHARED, sfd, 0);
                close(sfd);
                if (m != MAP_FAILED) st = m;
            } else if (sfd >= 0) {
                close(sfd);
            }
        }
        s[n].t = now_ns();
        s[n].avail_kib = mem_available_kib(fd);
        s[n].hog = st ? st->held_bytes : 0;
        n++;
        next += interval_us * 1000;
        int64_t wait = next - now_ns();
        if (wait > 0) {
            struct timespec ts = { wait / 1000000000LL, wait % 1000000000LL };
            nanosleep(&ts, NULL);
        } else {
            next = now_ns();
        }
    }
    FILE *f = fopen(out, "w");
    if (!f) { perror("sampler: --out"); return 1; }
    fprintf(f, "t_ns,avail_kib,hog_bytes\n");
    for (size_t i = 0; i < n; i++) fprintf(f, "%lld,%lld,%llu\n", (long long)s[i].t, (long long)s[i].avail_kib, (unsigned long long)s[i].hog);
    fclose(f);
    return 0;
}
