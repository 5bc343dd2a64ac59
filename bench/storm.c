/* storm.c: a fork storm for the gpuguard benchmarks: short-lived processes, many at once.
 *
 *   gg_bench_storm --live N --life-ms MS [--seconds S] [--total T]
 *
 * Keeps up to --live children alive at once (default 400), each living --life-ms (default 200,
 * +-50 % at random) before it exits, replacing each one that exits at once, for --seconds
 * (default: until SIGTERM) or until --total children have been started. Children are plain
 * forks (no exec) that sleep and _exit: the churn of pids, not CPU, is what it makes. Prints the
 * number of children started when it ends. SIGTERM/SIGINT end it; every child is killed and
 * reaped on the way out.
 *
 * Build: gcc -O2 -Wall -o gg_bench_storm storm.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_signal(int s) { (void)s; stop = 1; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long live = 400, life_ms = 200, total = -1;
    double seconds = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--live") && i + 1 < argc) live = atol(argv[++i]);
        else if (!strcmp(argv[i], "--life-ms") && i + 1 < argc) life_ms = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--total") && i + 1 < argc) total = atol(argv[++i]);
        else { fprintf(stderr, "usage: %s [--live N] [--life-ms MS] [--seconds S] [--total T]\n", argv[0]); return 2; }
    }
    pid_t *kids = calloc((size_t)live, sizeof *kids);
    if (!kids) return 1;
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    srand((unsigned)getpid());
    double end = seconds > 0 ? now_s() + seconds : 0;
    long started = 0, alive = 0;
    while (!stop && (total < 0 || started < total) && (end == 0 || now_s() < end)) {
        while (alive < live && (total < 0 || started < total) && !stop) {
            long ms = life_ms / 2 + (life_ms > 0 ? rand() % (life_ms + 1) : 0);
            pid_t pid = fork();
            if (pid == 0) {
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
                nanosleep(&ts, NULL);
                _exit(0);
            }
            if (pid < 0) break;
            for (long k = 0; k < live; k++)
                if (kids[k] == 0) { kids[k] = pid; break; }
            alive++;
            started++;
        }
        int status;
        pid_t done = waitpid(-1, &status, 0);
        if (done > 0) {
            for (long k = 0; k < live; k++)
                if (kids[k] == done) { kids[k] = 0; break; }
            alive--;
        } else if (errno == ECHILD) {
            alive = 0;
        }
    }
    for (long k = 0; k < live; k++)
        if (kids[k] > 0) kill(kids[k], SIGKILL);
    while (wait(NULL) > 0)
        ;
    printf("%ld\n", started);
    return 0;
}
