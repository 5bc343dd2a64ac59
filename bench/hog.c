/* hog.c: a memory hog for the gpuguard/earlyoom reaction benchmark.
 *
 * Fills anonymous memory in 1 MiB steps at --rate bytes/s (0 = as fast as it can), and stops by
 * itself at --cap bytes (safety: an agent that fails to act cannot take the host down) or, with
 * --stop-below BYTES, once MemAvailable is below BYTES (read every 16 MiB: on a VM that returns
 * memory freed earlier while the hog runs, MemAvailable need not fall by what the hog takes, and a
 * cap in bytes alone can stop the hog before it crosses the agent's floor), then holds
 * what it has for --hold seconds and exits 0. Every step publishes, in a small shared file
 * (--status, mmap'ed), how much it holds and the CLOCK_MONOTONIC time of its last growth, so the
 * analysis knows exactly when growth stopped even after the hog was killed.
 * --ignore-term: SIGTERM is ignored (only SIGKILL stops it).
 * It raises its own oom_score_adj to 1000 so that any OOM killer (kernel, earlyoom) picks it first.
 *
 * Build: gcc -O2 -Wall -o gg_bench_hog hog.c
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

struct hog_status {          /* layout shared with sampler.c */
    volatile uint64_t held_bytes;
    volatile int64_t last_growth_ns;
    volatile int64_t start_ns;
    volatile int32_t capped; /* 1: stopped at --cap or --stop-below (no agent stopped it) */
    volatile int32_t pid;
};

/* MemAvailable in bytes, or -1 when /proc/meminfo cannot be read. */
static int64_t mem_available(void) {
    char buf[4096];
    int fd = open("/proc/meminfo", O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    const char *p = strstr(buf, "MemAvailable:");
    return p ? strtoll(p + 13, NULL, 10) * 1024 : -1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    double rate = 0, hold = 5;
    uint64_t cap = 0;
    int64_t stop_below = 0;
    const char *status_path = NULL;
    int ignore_term = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rate") && i + 1 < argc) rate = atof(argv[++i]);
        else if (!strcmp(argv[i], "--cap") && i + 1 < argc) cap = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--stop-below") && i + 1 < argc) stop_below = strtoll(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--hold") && i + 1 < argc) hold = atof(argv[++i]);
        else if (!strcmp(argv[i], "--status") && i + 1 < argc) status_path = argv[++i];
        else if (!strcmp(argv[i], "--ignore-term")) ignore_term = 1;
        else { fprintf(stderr, "usage: %s --cap BYTES [--rate B/s] [--stop-below BYTES] [--hold S] [--status FILE] [--ignore-term]\n", argv[0]); return 2; }
    }
    if (cap == 0) { fprintf(stderr, "hog: --cap is required\n"); return 2; }
    if (ignore_term) signal(SIGTERM, SIG_IGN);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY);
    if (fd >= 0) { (void)!write(fd, "1000", 4); close(fd); }

    struct hog_status local = {0}, *st = &local;
    if (status_path) {
        /* Created full-size under a temporary name, then renamed: a reader never maps a short file. */
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", status_path);
        int sfd = open(tmp, O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (sfd < 0 || ftruncate(sfd, 4096) != 0) { perror("hog: status file"); return 1; }
        st = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, sfd, 0);
        if (st == MAP_FAILED) { perror("hog: mmap status"); return 1; }
        close(sfd);
        if (rename(tmp, status_path) != 0) { perror("hog: rename status"); return 1; }
    }
    st->pid = getpid();
    const uint64_t step = 1 << 20;
    char *mem = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) { perror("hog: mmap"); return 1; }
    int64_t t0 = now_ns();
    st->start_ns = t0;
    st->last_growth_ns = t0;
    uint64_t held = 0;
    while (held + step <= cap) {
        memset(mem + held, 0x5a, step); /* touch every page: real anonymous memory */
        held += step;
        st->held_bytes = held;
        st->last_growth_ns = now_ns();
        if (stop_below > 0 && held % (16 * step) == 0) {
            int64_t avail = mem_available();
            if (avail >= 0 && avail < stop_below) break;
        }
        if (rate > 0) {
            int64_t due = t0 + (int64_t)((double)held / rate * 1e9);
            int64_t wait = due - now_ns();
            if (wait > 0) {
                struct timespec ts = { wait / 1000000000LL, wait % 1000000000LL };
                nanosleep(&ts, NULL);
            }
        }
    }
    st->capped = 1;
    int64_t end = now_ns() + (int64_t)(hold * 1e9);
    while (now_ns() < end) usleep(10000);
    return 0;
}
