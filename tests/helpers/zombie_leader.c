/* zombie_leader.c: a process whose thread-group leader has exited while a worker thread holds
 * the memory (the way to hide from a guard that reads /proc/PID/stat: the leader shows state Z
 * and rss 0). Used by tests/integration/process_truth.rs.
 *
 *   zombie_leader TOKEN CAP_MIB STOP_BELOW_BYTES
 *
 * The main thread starts a worker and leaves with pthread_exit. The worker allocates and touches
 * 16 MiB at a time until it holds CAP_MIB, or MemAvailable is below STOP_BELOW_BYTES (0: no such
 * limit), prints "full" and waits for a signal. TOKEN only marks the command line.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static long cap_mib;
static long long stop_below;

static long long mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kib = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
    fclose(f);
    return kib * 1024;
}

static void *worker(void *arg) {
    (void)arg;
    long held = 0;
    while (held < cap_mib && (stop_below == 0 || mem_available() > stop_below)) {
        char *p = malloc(16 << 20);
        if (!p) break;
        memset(p, 1, 16 << 20);
        held += 16;
    }
    printf("full\n");
    fflush(stdout);
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s TOKEN CAP_MIB STOP_BELOW_BYTES\n", argv[0]);
        return 2;
    }
    cap_mib = atol(argv[2]);
    stop_below = atoll(argv[3]);
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0) return 1;
    pthread_exit(NULL);
}
