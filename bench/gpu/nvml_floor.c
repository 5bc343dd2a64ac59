/* nvml_floor.c: what loading NVML costs any program, step by step, on a real driver: after
 * nvmlInit and after each kind of call gpuguard makes (names, memory, utilization, process
 * lists, an Xid event set), this process's resident memory (anonymous and file-backed), its
 * threads, and whether the driver pulled libcuda in. Then it samples like a daemon (memory and
 * process lists every second, a thread waiting for Xid events) until killed, so a bench script
 * can read its peak RSS beside gpuguard's in the same window.
 *
 * Build: gcc -O2 -Wall -o nvml_floor nvml_floor.c -ldl -lpthread
 * Run:   nvml_floor [SECONDS]      (prints one line per step to stdout)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef void *dev_t_;
typedef struct { unsigned long long total, free, used; } mem_t;
typedef struct { unsigned int gpu, memory; } util_t;
typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } proc_t;
typedef struct { dev_t_ dev; unsigned long long type, data; unsigned int gi, ci; } event_t;

static int (*init)(void);
static int (*by_index)(unsigned int, dev_t_ *);
static int (*get_name)(dev_t_, char *, unsigned int);
static int (*get_uuid)(dev_t_, char *, unsigned int);
static int (*mem_info)(dev_t_, mem_t *);
static int (*util)(dev_t_, util_t *);
static int (*compute)(dev_t_, unsigned int *, proc_t *);
static int (*graphics)(dev_t_, unsigned int *, proc_t *);
static int (*set_create)(void **);
static int (*reg)(dev_t_, unsigned long long, void *);
static int (*set_wait)(void *, event_t *, unsigned int);

static void report(const char *step) {
    char line[256], out[512] = "";
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS", 5) || !strncmp(line, "RssAnon", 7) ||
            !strncmp(line, "RssFile", 7) || !strncmp(line, "Threads", 7)) {
            line[strcspn(line, "\n")] = ' ';
            strcat(out, line);
        }
    if (f) fclose(f);
    int cuda = 0;
    f = fopen("/proc/self/maps", "r");
    while (f && fgets(line, sizeof line, f)) cuda |= strstr(line, "libcuda") != NULL;
    if (f) fclose(f);
    printf("%-28s %s libcuda=%s\n", step, out, cuda ? "mapped" : "no");
    fflush(stdout);
}

#define SYM(var, name) do { *(void **)&var = dlsym(lib, name); if (!var) { fprintf(stderr, "no %s\n", name); return 1; } } while (0)

static void *xids(void *set) {
    event_t e;
    for (;;) set_wait(set, &e, 2000);
    return NULL;
}

int main(int argc, char **argv) {
    int seconds = argc > 1 ? atoi(argv[1]) : 30;
    report("start");
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    report("dlopen");
    SYM(init, "nvmlInit_v2"); SYM(by_index, "nvmlDeviceGetHandleByIndex_v2");
    SYM(get_name, "nvmlDeviceGetName"); SYM(get_uuid, "nvmlDeviceGetUUID");
    SYM(mem_info, "nvmlDeviceGetMemoryInfo"); SYM(util, "nvmlDeviceGetUtilizationRates");
    SYM(compute, "nvmlDeviceGetComputeRunningProcesses_v3");
    SYM(graphics, "nvmlDeviceGetGraphicsRunningProcesses_v3");
    SYM(set_create, "nvmlEventSetCreate"); SYM(reg, "nvmlDeviceRegisterEvents");
    SYM(set_wait, "nvmlEventSetWait_v2");
    if (init()) { fprintf(stderr, "nvmlInit failed\n"); return 1; }
    report("nvmlInit");
    dev_t_ dev; char buf[96]; mem_t m; util_t u; proc_t p[64]; unsigned int n;
    by_index(0, &dev); get_name(dev, buf, sizeof buf); get_uuid(dev, buf, sizeof buf);
    report("handle, name, uuid");
    mem_info(dev, &m);
    report("memory info");
    util(dev, &u);
    report("utilization");
    n = 64; compute(dev, &n, p); n = 64; graphics(dev, &n, p);
    report("process lists");
    void *set; set_create(&set); reg(dev, 0x8 /* Xid critical */, set);
    pthread_t t; pthread_create(&t, NULL, xids, set);
    usleep(100000);
    report("Xid event set, waiting");
    for (int i = 0; i < seconds; i++) {
        mem_info(dev, &m); util(dev, &u);
        n = 64; compute(dev, &n, p); n = 64; graphics(dev, &n, p);
        sleep(1);
    }
    report("sampled every second");
    return 0;
}
