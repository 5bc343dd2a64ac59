/*
 * fake_nvml.c - a scripted fake of libnvidia-ml.so.1 for gpuguard's tests.
 *
 * Exports the NVML symbols gpuguard (through the nvml-wrapper crate) uses, with
 * the x86_64 layouts of the real library. Every call checks the state file
 * named by $FAKE_NVML_STATE and parses it again if it has changed (another
 * inode, size or mtime), so a test can change what the "GPUs" report while
 * a daemon runs (write the file atomically: temp file + rename). The format is
 * documented in README.md next to this file.
 *
 * Built by build.rs into $OUT_DIR/fake_nvml/libnvidia-ml.so.1.
 *
 * Everything that touches the global state runs under one mutex (the real
 * driver serialises calls too); injected delays and event waits sleep with the
 * mutex released. An event wait blocks until the state file's directory changes
 * (inotify) or its timeout, as the real driver blocks in the kernel, so an idle
 * daemon costs what it would cost against real GPUs.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML ABI (x86_64) ------------------------------------------------ */

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_EVENT_TYPE_XID_CRITICAL_ERROR 0x8ULL
/* single/double bit ECC, pstate, Xid, clock: what a Fermi+ board reports */
#define FAKE_SUPPORTED_EVENTS 0x1FULL
#define NVML_NO_INSTANCE 0xFFFFFFFFu
#define NVML_VALUE_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL
#define NVML_TEMPERATURE_GPU 0

typedef struct nvmlDevice_st {
    unsigned int index;
} *nvmlDevice_t;

typedef struct {
    unsigned int version; /* sizeof | 2 << 24 */
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define MAX_DEVICES 64
typedef struct nvmlEventSet_st {
    int in_use;
    unsigned long long mask[MAX_DEVICES];  /* registered event types per GPU */
    unsigned long long since[MAX_DEVICES]; /* Xids up to this sequence number came before
                                              the set registered for that GPU's Xids */
    unsigned long long delivered;          /* the last sequence number this set delivered */
} *nvmlEventSet_t;

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(offsetof(nvmlMemory_v2_t, total) == 8, "nvmlMemory_v2_t.total");
_Static_assert(offsetof(nvmlMemory_v2_t, reserved) == 16, "nvmlMemory_v2_t.reserved");
_Static_assert(offsetof(nvmlMemory_v2_t, free) == 24, "nvmlMemory_v2_t.free");
_Static_assert(offsetof(nvmlMemory_v2_t, used) == 32, "nvmlMemory_v2_t.used");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(offsetof(nvmlProcessInfo_t, usedGpuMemory) == 8, "usedGpuMemory");
_Static_assert(offsetof(nvmlProcessInfo_t, gpuInstanceId) == 16, "gpuInstanceId");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");
_Static_assert(offsetof(nvmlEventData_t, eventData) == 16, "eventData");

/* ---- state file ------------------------------------------------------- */

#define MAX_PROCESSES 4096
#define MAX_RULES 256
#define MAX_XIDS 1024
#define MAX_EVENT_SETS 64
#define MAX_SEEN 8192
#define MAX_LINE 1024
#define MAX_TOKENS 32
#define NAME_LEN 96    /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */
#define UUID_LEN 96    /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define VERSION_LEN 80 /* NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE */
#define FN_LEN 64
#define MAX_DELAY_MS 600000ULL

struct fake_gpu {
    int present;
    char name[NAME_LEN];
    char uuid[UUID_LEN];
    unsigned long long total, used, reserved;
    int has_free;            /* `free=` given: reported as is, even if inconsistent */
    unsigned long long free;
    unsigned int util, memutil, temp;
    /* `process_count`: what the size query of each list (compute, graphics) claims; 0 = real */
    unsigned long long claimed[2];
};

struct fake_proc {
    unsigned int gpu, pid;
    unsigned long long used; /* NVML_VALUE_NOT_AVAILABLE for NA */
    int graphics;
};

struct fake_rule { /* an `error`, `delay` or `hold` line */
    char fn[FN_LEN];   /* symbol name, or "*" for every function */
    int gpu;           /* -1: any call; N: only calls about GPU N */
    unsigned long long value; /* return code or milliseconds */
};

struct fake_xid {
    unsigned int gpu;
    unsigned long long xid, id;
    unsigned long long seq; /* when the library first read it: the order events happened in */
};

struct fake_state {
    char driver_version[VERSION_LEN];
    unsigned int ndev; /* highest declared index + 1 */
    int has_count;     /* `device_count`: what nvmlDeviceGetCount_v2 claims instead of ndev */
    unsigned int count;
    struct fake_gpu gpu[MAX_DEVICES];
    unsigned int nproc, nerr, ndelay, nhold, nxid;
    struct fake_proc proc[MAX_PROCESSES];
    struct fake_rule err[MAX_RULES];
    struct fake_rule delay[MAX_RULES];
    struct fake_rule hold[MAX_RULES];
    struct fake_xid xid[MAX_XIDS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_state g_state;
static struct nvmlDevice_st g_handles[MAX_DEVICES];
static struct nvmlEventSet_st g_sets[MAX_EVENT_SETS];
static struct fake_xid g_seen[MAX_SEEN]; /* ring of the Xids read so far, with their seq */
static unsigned int g_nseen;
static unsigned long long g_xid_seq; /* the last sequence number given to an Xid */
static unsigned int g_init_count;

static void debug(const char *path, unsigned int lineno, const char *why)
{
    if (getenv("FAKE_NVML_DEBUG"))
        fprintf(stderr, "fake_nvml: %s:%u: ignored line: %s\n", path, lineno, why);
}

/* Splits a line in place into whitespace-separated tokens. Double quotes group
 * (and are removed): name="Fake H100". An unquoted token starting with '#'
 * ends the line. Returns the count, or -1 for an unterminated quote or too
 * many tokens. */
static int tokenize(char *s, char **tok, int max)
{
    char *r = s, *w = s;
    int n = 0;

    for (;;) {
        while (*r && isspace((unsigned char)*r))
            r++;
        if (*r == '\0' || *r == '#')
            return n;
        if (n == max)
            return -1;
        tok[n++] = w;
        int quoted = 0;
        while (*r && (quoted || !isspace((unsigned char)*r))) {
            if (*r == '"')
                quoted = !quoted;
            else
                *w++ = *r;
            r++;
        }
        if (quoted)
            return -1;
        if (*r)
            r++; /* skip the separator; w never passes r, so the NUL is safe */
        *w++ = '\0';
    }
}

/* Plain decimal only: no sign, no spaces, no overflow, at most `max`. */
static int parse_u64(const char *s, unsigned long long max, unsigned long long *out)
{
    char *end;
    if (!isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (parse_u64(s, 0xFFFFFFFFULL, &v))
        return -1;
    *out = (unsigned int)v;
    return 0;
}

static int copy_str(char *dst, size_t cap, const char *src)
{
    size_t len = strlen(src);
    if (len == 0 || len >= cap)
        return -1;
    memcpy(dst, src, len + 1);
    return 0;
}

/* device IDX [name=..] [uuid=..] [total=..] [used=..] [reserved=..] [util=..] [memutil=..] [temp=..] */
static const char *parse_device(char **tok, int n)
{
    unsigned int idx;
    struct fake_gpu g;

    if (n < 2 || parse_u32(tok[1], &idx) || idx >= MAX_DEVICES)
        return "bad device index";
    memset(&g, 0, sizeof(g));
    g.present = 1;
    snprintf(g.name, sizeof(g.name), "Fake GPU %u", idx);
    snprintf(g.uuid, sizeof(g.uuid), "GPU-00000000-0000-0000-0000-%012u", idx);
    for (int i = 2; i < n; i++) {
        char *eq = strchr(tok[i], '=');
        if (!eq)
            return "expected key=value";
        *eq = '\0';
        const char *k = tok[i], *v = eq + 1;
        int bad;
        if (!strcmp(k, "name"))
            bad = copy_str(g.name, sizeof(g.name), v);
        else if (!strcmp(k, "uuid"))
            bad = copy_str(g.uuid, sizeof(g.uuid), v);
        else if (!strcmp(k, "total"))
            bad = parse_u64(v, ~0ULL, &g.total);
        else if (!strcmp(k, "used"))
            bad = parse_u64(v, ~0ULL, &g.used);
        else if (!strcmp(k, "reserved"))
            bad = parse_u64(v, ~0ULL, &g.reserved);
        else if (!strcmp(k, "free")) {
            bad = parse_u64(v, ~0ULL, &g.free);
            g.has_free = 1;
        }
        else if (!strcmp(k, "util"))
            bad = parse_u32(v, &g.util);
        else if (!strcmp(k, "memutil"))
            bad = parse_u32(v, &g.memutil);
        else if (!strcmp(k, "temp"))
            bad = parse_u32(v, &g.temp);
        else
            return "unknown device key";
        if (bad)
            return "bad device value";
    }
    g.claimed[0] = g_state.gpu[idx].claimed[0];
    g.claimed[1] = g_state.gpu[idx].claimed[1];
    g_state.gpu[idx] = g;
    if (idx + 1 > g_state.ndev)
        g_state.ndev = idx + 1;
    return NULL;
}

/* process GPU PID BYTES|NA [compute|graphics] */
static const char *parse_process(char **tok, int n)
{
    struct fake_proc p = {0};

    if (n < 4 || n > 5)
        return "expected: process GPU PID BYTES|NA [compute|graphics]";
    if (parse_u32(tok[1], &p.gpu) || p.gpu >= MAX_DEVICES || parse_u32(tok[2], &p.pid))
        return "bad gpu or pid";
    if (!strcmp(tok[3], "NA"))
        p.used = NVML_VALUE_NOT_AVAILABLE;
    else if (parse_u64(tok[3], ~0ULL, &p.used))
        return "bad used bytes";
    if (n == 5 && !strcmp(tok[4], "graphics"))
        p.graphics = 1;
    else if (n == 5 && strcmp(tok[4], "compute"))
        return "expected compute or graphics";
    if (g_state.nproc == MAX_PROCESSES)
        return "too many processes";
    g_state.proc[g_state.nproc++] = p;
    return NULL;
}

/* process_count GPU N [compute|graphics]: the list's size query claims N processes */
static const char *parse_process_count(char **tok, int n)
{
    unsigned int gpu;
    unsigned long long count;
    int graphics = 0;

    if (n < 3 || n > 4)
        return "expected: process_count GPU N [compute|graphics]";
    if (parse_u32(tok[1], &gpu) || gpu >= MAX_DEVICES || parse_u64(tok[2], 0xFFFFFFFFULL, &count))
        return "bad gpu or count";
    if (n == 4 && !strcmp(tok[3], "graphics"))
        graphics = 1;
    else if (n == 4 && strcmp(tok[3], "compute"))
        return "expected compute or graphics";
    g_state.gpu[gpu].claimed[graphics] = count;
    return NULL;
}

/* hold FN [gpu=N] */
static const char *parse_hold(char **tok, int n)
{
    struct fake_rule r = {.gpu = -1, .value = 1};
    unsigned int gpu;

    if (n < 2 || n > 3)
        return "expected: hold FN [gpu=N]";
    if (copy_str(r.fn, sizeof(r.fn), tok[1]))
        return "bad function name";
    if (n == 3) {
        if (strncmp(tok[2], "gpu=", 4) || parse_u32(tok[2] + 4, &gpu) || gpu >= MAX_DEVICES)
            return "expected gpu=N";
        r.gpu = (int)gpu;
    }
    if (g_state.nhold == MAX_RULES)
        return "too many hold lines";
    g_state.hold[g_state.nhold++] = r;
    return NULL;
}

/* error FN CODE [gpu=N]  /  delay FN MS [gpu=N] */
static const char *parse_rule(char **tok, int n, int is_delay)
{
    struct fake_rule r = {.gpu = -1};
    unsigned int gpu;

    if (n < 3 || n > 4)
        return "expected: error|delay FN VALUE [gpu=N]";
    if (copy_str(r.fn, sizeof(r.fn), tok[1]))
        return "bad function name";
    if (parse_u64(tok[2], is_delay ? MAX_DELAY_MS : 0x7FFFFFFFULL, &r.value))
        return "bad value";
    if (n == 4) {
        if (strncmp(tok[3], "gpu=", 4) || parse_u32(tok[3] + 4, &gpu) || gpu >= MAX_DEVICES)
            return "expected gpu=N";
        r.gpu = (int)gpu;
    }
    if (r.value == 0)
        return NULL; /* "return success" / "no delay": nothing to do */
    if (is_delay) {
        if (g_state.ndelay == MAX_RULES)
            return "too many delay lines";
        g_state.delay[g_state.ndelay++] = r;
    } else {
        if (g_state.nerr == MAX_RULES)
            return "too many error lines";
        g_state.err[g_state.nerr++] = r;
    }
    return NULL;
}

/* xid GPU XID [id=ID] */
static const char *parse_xid(char **tok, int n)
{
    struct fake_xid x = {0};

    if (n < 3 || n > 4)
        return "expected: xid GPU XID [id=ID]";
    if (parse_u32(tok[1], &x.gpu) || x.gpu >= MAX_DEVICES || parse_u64(tok[2], ~0ULL, &x.xid))
        return "bad gpu or xid";
    if (n == 4 && (strncmp(tok[3], "id=", 3) || parse_u64(tok[3] + 3, ~0ULL, &x.id)))
        return "expected id=N";
    if (g_state.nxid == MAX_XIDS)
        return "too many xid lines";
    g_state.xid[g_state.nxid++] = x;
    return NULL;
}

static void parse_line(char *line, const char *path, unsigned int lineno)
{
    char *tok[MAX_TOKENS];
    const char *why = NULL;
    int n = tokenize(line, tok, MAX_TOKENS);

    if (n < 0)
        why = "unterminated quote or too many tokens";
    else if (n == 0)
        return;
    else if (!strcmp(tok[0], "driver_version"))
        why = (n == 2 && !copy_str(g_state.driver_version, VERSION_LEN, tok[1])) ? NULL
                                                                                 : "bad driver_version";
    else if (!strcmp(tok[0], "device"))
        why = parse_device(tok, n);
    else if (!strcmp(tok[0], "process"))
        why = parse_process(tok, n);
    else if (!strcmp(tok[0], "process_count"))
        why = parse_process_count(tok, n);
    else if (!strcmp(tok[0], "device_count")) {
        unsigned int count;
        why = (n == 2 && !parse_u32(tok[1], &count)) ? NULL : "bad device_count";
        if (!why) {
            g_state.has_count = 1;
            g_state.count = count;
        }
    }
    else if (!strcmp(tok[0], "error"))
        why = parse_rule(tok, n, 0);
    else if (!strcmp(tok[0], "delay"))
        why = parse_rule(tok, n, 1);
    else if (!strcmp(tok[0], "hold"))
        why = parse_hold(tok, n);
    else if (!strcmp(tok[0], "xid"))
        why = parse_xid(tok, n);
    else
        why = "unknown keyword";
    if (why)
        debug(path, lineno, why);
}

/* Gives an Xid read for the first time the next sequence number (the moment the
 * "driver" raised it); one read before keeps its number. */
static void number_xid(struct fake_xid *x)
{
    unsigned int n = g_nseen < MAX_SEEN ? g_nseen : MAX_SEEN;
    for (unsigned int i = 0; i < n; i++) {
        const struct fake_xid *seen = &g_seen[i];
        if (seen->gpu == x->gpu && seen->xid == x->xid && seen->id == x->id) {
            x->seq = seen->seq;
            return;
        }
    }
    x->seq = ++g_xid_seq;
    g_seen[g_nseen++ % MAX_SEEN] = *x;
}

/* Which file g_state was parsed from: it is parsed again only when the file
 * changed (another inode, as with temp + rename, or another size or mtime). */
static struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} g_loaded;

static int same_file(const struct stat *st)
{
    return g_loaded.valid && st->st_dev == g_loaded.dev && st->st_ino == g_loaded.ino &&
           st->st_size == g_loaded.size && st->st_mtim.tv_sec == g_loaded.mtime.tv_sec &&
           st->st_mtim.tv_nsec == g_loaded.mtime.tv_nsec;
}

/* Re-reads the state file into g_state (lock held) if it changed since it was
 * last parsed (always with FAKE_NVML_DEBUG). On failure (variable unset, file
 * unreadable) g_state is left as it was and -1 is returned. */
static int load_state(void)
{
    const char *path = getenv("FAKE_NVML_STATE");
    char line[MAX_LINE];
    unsigned int lineno = 0;
    struct stat st;
    FILE *f;

    if (!path || !*path || stat(path, &st) != 0)
        return -1;
    if (same_file(&st) && !getenv("FAKE_NVML_DEBUG"))
        return 0;
    if (!(f = fopen(path, "re")))
        return -1;
    if (fstat(fileno(f), &st) == 0) {
        g_loaded.valid = 1;
        g_loaded.dev = st.st_dev;
        g_loaded.ino = st.st_ino;
        g_loaded.size = st.st_size;
        g_loaded.mtime = st.st_mtim;
    }
    memset(g_state.driver_version, 0, sizeof(g_state.driver_version));
    strcpy(g_state.driver_version, "550.54.15");
    g_state.ndev = g_state.nproc = g_state.nerr = g_state.ndelay = g_state.nhold = g_state.nxid = 0;
    g_state.has_count = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        g_state.gpu[i].present = 0;
        g_state.gpu[i].claimed[0] = g_state.gpu[i].claimed[1] = 0;
    }
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof(line) - 1 && line[len - 1] != '\n' && !feof(f)) {
            int c; /* overlong: skip the rest and ignore it */
            while ((c = fgetc(f)) != EOF && c != '\n')
                ;
            debug(path, lineno, "line too long");
            continue;
        }
        parse_line(line, path, lineno);
    }
    fclose(f);
    for (unsigned int i = 0; i < g_state.nxid; i++)
        number_xid(&g_state.xid[i]);
    return 0;
}

/* ---- call plumbing ---------------------------------------------------- */

static void sleep_ms(unsigned long long ms)
{
    struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

static unsigned long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + (unsigned long long)ts.tv_nsec / 1000000ULL;
}

/* First matching `error`/`delay` line: same function (or "*"), and either no
 * gpu= or gpu= naming the GPU this call is about. */
static unsigned long long find_rule(const struct fake_rule *rules, unsigned int n, const char *fn, int gpu)
{
    for (unsigned int i = 0; i < n; i++)
        if ((!strcmp(rules[i].fn, fn) || !strcmp(rules[i].fn, "*")) && (rules[i].gpu < 0 || rules[i].gpu == gpu))
            return rules[i].value;
    return 0;
}

/* Appends "FN GPU" (GPU is - when the call is about no GPU) to $FAKE_NVML_LOG. */
static void log_call(const char *fn, int gpu)
{
    const char *path = getenv("FAKE_NVML_LOG");
    char buf[FN_LEN + 32];
    int fd, len;

    if (!path || !*path)
        return;
    if (gpu >= 0)
        len = snprintf(buf, sizeof(buf), "%s %d\n", fn, gpu);
    else
        len = snprintf(buf, sizeof(buf), "%s -\n", fn);
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, buf, (size_t)len) < 0) {
        /* nothing to do: the log is best effort */
    }
    close(fd);
}

static nvmlReturn_t leave(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Every entry point (except nvmlErrorString) starts here: take the lock,
 * re-read the state file, sleep for a matching `delay`, wait while a matching
 * `hold` is in the state (a test releases the call by writing a state without
 * it, once $FAKE_NVML_LOG shows the call came), return a matching `error`. On NVML_SUCCESS the lock is held and g_state is fresh; the caller
 * ends with leave(). Otherwise the lock is released. */
static nvmlReturn_t enter(const char *fn, int gpu, int needs_init)
{
    pthread_mutex_lock(&g_lock);
    log_call(fn, gpu);
    if (needs_init && g_init_count == 0)
        return leave(NVML_ERROR_UNINITIALIZED);
    if (load_state())
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    unsigned long long delay = find_rule(g_state.delay, g_state.ndelay, fn, gpu);
    if (delay) {
        pthread_mutex_unlock(&g_lock);
        sleep_ms(delay);
        pthread_mutex_lock(&g_lock);
        if (load_state())
            return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    while (find_rule(g_state.hold, g_state.nhold, fn, gpu)) {
        pthread_mutex_unlock(&g_lock);
        sleep_ms(1);
        pthread_mutex_lock(&g_lock);
        if (load_state())
            return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    nvmlReturn_t injected = (nvmlReturn_t)find_rule(g_state.err, g_state.nerr, fn, gpu);
    if (injected)
        return leave(injected);
    return NVML_SUCCESS;
}

static int handle_index(nvmlDevice_t dev)
{
    uintptr_t p = (uintptr_t)dev, base = (uintptr_t)g_handles;
    if (p < base || p >= base + sizeof(g_handles) || (p - base) % sizeof(g_handles[0]))
        return -1;
    return (int)((p - base) / sizeof(g_handles[0]));
}

/* enter() for calls on a device handle; *g is the device's state. */
static nvmlReturn_t enter_device(const char *fn, nvmlDevice_t dev, struct fake_gpu **g)
{
    int idx = handle_index(dev);
    nvmlReturn_t rc = enter(fn, idx, 1);
    if (rc)
        return rc;
    if (idx < 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g_state.gpu[idx].present)
        return leave(NVML_ERROR_GPU_IS_LOST);
    *g = &g_state.gpu[idx];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_out(char *dst, unsigned int cap, const char *src)
{
    size_t len = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (len + 1 > cap)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, len + 1);
    return NVML_SUCCESS;
}

static int valid_set(nvmlEventSet_t set)
{
    uintptr_t p = (uintptr_t)set, base = (uintptr_t)g_sets;
    return p >= base && p < base + sizeof(g_sets) && (p - base) % sizeof(g_sets[0]) == 0 && set->in_use;
}

/* ---- exported symbols ------------------------------------------------- */

static nvmlReturn_t init_common(const char *fn)
{
    nvmlReturn_t rc = enter(fn, -1, 0);
    if (rc)
        return rc;
    if (g_init_count == 0)
        for (unsigned int i = 0; i < MAX_DEVICES; i++)
            g_handles[i].index = i;
    g_init_count++;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return init_common("nvmlInit_v2"); }
nvmlReturn_t nvmlInit(void) { return init_common("nvmlInit"); }

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    log_call("nvmlShutdown", -1);
    if (g_init_count == 0)
        return leave(NVML_ERROR_UNINITIALIZED);
    g_init_count--;
    /* a missing state file does not fail shutdown; an `error` line does */
    if (load_state() == 0)
        return leave((nvmlReturn_t)find_rule(g_state.err, g_state.nerr, "nvmlShutdown", -1));
    return leave(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t rc)
{
    switch (rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires reset";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = enter(__func__, -1, 1);
    if (rc)
        return rc;
    return leave(copy_out(version, length, g_state.driver_version));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t rc = enter(__func__, -1, 1);
    if (rc)
        return rc;
    if (!count)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = g_state.has_count ? g_state.count : g_state.ndev;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter(__func__, index < MAX_DEVICES ? (int)index : -1, 1);
    if (rc)
        return rc;
    unsigned int listed = g_state.has_count && g_state.count > g_state.ndev ? g_state.count : g_state.ndev;
    if (!device || index >= listed || index >= MAX_DEVICES)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    /* an index the count claims but no `device` line declares: fallen off the bus */
    if (index >= g_state.ndev || !g_state.gpu[index].present)
        return leave(NVML_ERROR_GPU_IS_LOST);
    *device = &g_handles[index];
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter(__func__, -1, 1);
    if (rc)
        return rc;
    if (!uuid || !device)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int i = 0; i < g_state.ndev; i++) {
        if (g_state.gpu[i].present && !strcmp(g_state.gpu[i].uuid, uuid)) {
            *device = &g_handles[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!index)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(g - g_state.gpu);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    return leave(copy_out(name, length, g->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    return leave(copy_out(uuid, length, g->uuid));
}

static unsigned long long free_bytes(const struct fake_gpu *g)
{
    if (g->has_free)
        return g->free;
    unsigned long long taken = g->used + g->reserved;
    if (taken < g->used || taken > g->total) /* overflow, or more than total */
        return 0;
    return g->total - taken;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!memory)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2_VERSION)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = g->total;
    memory->reserved = g->reserved;
    memory->used = g->used;
    memory->free = free_bytes(g);
    return leave(NVML_SUCCESS);
}

/* v1: `used` includes the driver-reserved memory, `free` is the same as v2 */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!memory)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    memory->total = g->total;
    memory->free = free_bytes(g);
    memory->used = g->total - memory->free;
    return leave(NVML_SUCCESS);
}

/* The two-call protocol: *count too small (0 with infos NULL, typically) ->
 * INSUFFICIENT_SIZE and *count = needed; no processes -> SUCCESS, *count = 0. */
static nvmlReturn_t processes(const char *fn, nvmlDevice_t device, unsigned int *count,
                              nvmlProcessInfo_t *infos, int graphics)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc)
        return rc;
    if (!count)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int gpu = (unsigned int)(g - g_state.gpu), needed = 0;
    for (unsigned int i = 0; i < g_state.nproc; i++)
        if (g_state.proc[i].gpu == gpu && g_state.proc[i].graphics == graphics)
            needed++;
    unsigned long long claimed = g->claimed[graphics];
    if (claimed && *count < claimed) {
        *count = (unsigned int)claimed; /* what a confused driver claims */
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (*count < needed) {
        *count = needed;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (needed > 0 && !infos)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (unsigned int i = 0; i < g_state.nproc; i++) {
        const struct fake_proc *p = &g_state.proc[i];
        if (p->gpu != gpu || p->graphics != graphics)
            continue;
        infos[n].pid = p->pid;
        infos[n].usedGpuMemory = p->used;
        infos[n].gpuInstanceId = NVML_NO_INSTANCE;
        infos[n].computeInstanceId = NVML_NO_INSTANCE;
        n++;
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    return processes(__func__, device, infoCount, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    return processes(__func__, device, infoCount, infos, 1);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!utilization)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = g->util;
    utilization->memory = g->memutil;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!temp || sensorType != NVML_TEMPERATURE_GPU)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *temp = g->temp;
    return leave(NVML_SUCCESS);
}

/* ---- events ----------------------------------------------------------- */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t rc = enter(__func__, -1, 1);
    if (rc)
        return rc;
    if (!set)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!g_sets[i].in_use) {
            memset(&g_sets[i], 0, sizeof(g_sets[i]));
            g_sets[i].in_use = 1;
            *set = &g_sets[i];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_MEMORY);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!eventTypes)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = FAKE_SUPPORTED_EVENTS;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    struct fake_gpu *g;
    nvmlReturn_t rc = enter_device(__func__, device, &g);
    if (rc)
        return rc;
    if (!valid_set(set))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~FAKE_SUPPORTED_EVENTS)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned int gpu = (unsigned int)(g - g_state.gpu);
    /* Like a driver, a set hears of the Xids raised after it registered for them. */
    if ((eventTypes & NVML_EVENT_TYPE_XID_CRITICAL_ERROR) &&
        !(set->mask[gpu] & NVML_EVENT_TYPE_XID_CRITICAL_ERROR))
        set->since[gpu] = g_xid_seq;
    set->mask[gpu] |= eventTypes;
    return leave(NVML_SUCCESS);
}

/* The oldest Xid this set has not delivered, raised after it registered for that
 * GPU's Xids, on a GPU present now; 0 if none. Each set has a queue of its own,
 * as with a driver: every set registered for an Xid gets it, once. */
static int take_xid(nvmlEventSet_t set, nvmlEventData_t *data)
{
    const struct fake_xid *next = NULL;
    for (unsigned int i = 0; i < g_state.nxid; i++) {
        const struct fake_xid *x = &g_state.xid[i];
        if (!(set->mask[x->gpu] & NVML_EVENT_TYPE_XID_CRITICAL_ERROR) || !g_state.gpu[x->gpu].present ||
            x->seq <= set->since[x->gpu] || x->seq <= set->delivered)
            continue;
        if (!next || x->seq < next->seq)
            next = x;
    }
    if (!next)
        return 0;
    set->delivered = next->seq;
    data->device = &g_handles[next->gpu];
    data->eventType = NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
    data->eventData = next->xid;
    data->gpuInstanceId = NVML_NO_INSTANCE;
    data->computeInstanceId = NVML_NO_INSTANCE;
    return 1;
}

/* An inotify watch on the state file's directory (a new state is written and
 * renamed into place there), or -1 where inotify is not available. */
static int watch_state_dir(void)
{
    const char *path = getenv("FAKE_NVML_STATE");
    char dir[4096];
    if (!path || !*path || strlen(path) >= sizeof(dir))
        return -1;
    strcpy(dir, path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        slash[1] = 0;
    else if (slash)
        *slash = 0;
    else
        strcpy(dir, ".");
    int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (fd >= 0 &&
        inotify_add_watch(fd, dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ATTRIB) < 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Sleeps until the watched directory changes or `ms` pass, then empties the
 * watch's queue; without a watch, sleeps at most 100 ms (polling). */
static void wait_for_state_change(int watch, unsigned long long ms)
{
    if (watch < 0) {
        sleep_ms(ms < 100 ? ms : 100);
        return;
    }
    struct pollfd p = {.fd = watch, .events = POLLIN};
    int timeout = ms > 60000 ? 60000 : (int)ms;
    while (poll(&p, 1, timeout) == -1 && errno == EINTR)
        ;
    char buf[4096];
    while (read(watch, buf, sizeof(buf)) > 0)
        ;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    /* Watching before the first read of the state: a state renamed into place
     * between that read and the wait still wakes it. */
    int watch = watch_state_dir();
    nvmlReturn_t rc = enter(__func__, -1, 1);
    if (rc) {
        if (watch >= 0)
            close(watch);
        return rc;
    }
    /* +1: now_ms() truncates, so a deadline in whole ms could come up to 1 ms early. */
    unsigned long long deadline = now_ms() + timeoutms + 1;
    for (;;) {
        unsigned long long now = now_ms();
        if (!valid_set(set) || !data)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (take_xid(set, data))
            rc = NVML_SUCCESS;
        else if (now >= deadline)
            rc = NVML_ERROR_TIMEOUT;
        else {
            pthread_mutex_unlock(&g_lock);
            wait_for_state_change(watch, deadline - now);
            pthread_mutex_lock(&g_lock);
            load_state(); /* on failure keep the last state and wait on */
            continue;
        }
        if (watch >= 0)
            close(watch);
        return leave(rc);
    }
}

/* Like nvmlShutdown: a missing state file does not leak the set. */
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t rc;
    pthread_mutex_lock(&g_lock);
    log_call(__func__, -1);
    if (g_init_count == 0)
        return leave(NVML_ERROR_UNINITIALIZED);
    if (load_state() == 0 && (rc = (nvmlReturn_t)find_rule(g_state.err, g_state.nerr, __func__, -1)))
        return leave(rc);
    if (!valid_set(set))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    set->in_use = 0;
    return leave(NVML_SUCCESS);
}
