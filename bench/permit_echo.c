/* permit_echo.c: the floor for a permit round trip on this machine. A one-thread epoll server on
 * a unix stream socket that answers the permit protocol's `acquire` with `granted` and
 * `release_permit` with `released` at once, deciding nothing: what any socket daemon pays in
 * the kernel and the scheduler, without gpuguard's work. benches/permits.rs runs its cases
 * against it with PERMIT_SERVER=bench/build/permit_echo, beside gpuguard in the same run.
 *
 *   cc -O2 -o bench/build/permit_echo bench/permit_echo.c
 *   permit_echo SOCKET
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_FD 4096
#define BUF 65536

struct conn {
    char in[BUF];
    size_t len;
};

static struct conn *conns[MAX_FD];

static unsigned long long field(const char *line, const char *name) {
    const char *at = strstr(line, name);
    return at ? strtoull(at + strlen(name), NULL, 10) : 0;
}

/* Answers every complete line in c->in; returns -1 when the connection should close. */
static int answer(int fd, struct conn *c) {
    static unsigned long long next_permit;
    char out[BUF];
    size_t out_len = 0, start = 0;
    for (size_t i = 0; i < c->len; i++) {
        if (c->in[i] != '\n')
            continue;
        c->in[i] = 0;
        const char *line = c->in + start;
        unsigned long long id = field(line, "\"id\":");
        if (out_len + 256 > sizeof out)
            return -1;
        if (strstr(line, "\"acquire\""))
            out_len += snprintf(out + out_len, sizeof out - out_len,
                                "{\"type\":\"granted\",\"id\":%llu,\"permit\":%llu,\"gpu\":0,"
                                "\"gpu_bytes\":67108864,\"ram_bytes\":0,\"waited_ms\":0,"
                                "\"ttl_ms\":300000}\n",
                                id, ++next_permit);
        else
            out_len += snprintf(out + out_len, sizeof out - out_len,
                                "{\"type\":\"released\",\"id\":%llu,\"permit\":%llu}\n", id,
                                field(line, "\"permit\":"));
        start = i + 1;
    }
    memmove(c->in, c->in + start, c->len - start);
    c->len -= start;
    if (c->len == sizeof c->in)
        return -1;
    for (size_t done = 0; done < out_len;) {
        ssize_t n = write(fd, out + done, out_len - done);
        if (n < 0)
            return -1; /* the bench's clients read every answer: a full socket is a bug */
        done += n;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: permit_echo SOCKET\n");
        return 2;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, argv[1], sizeof addr.sun_path - 1);
    int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    unlink(argv[1]);
    if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        listen(listener, 1024) < 0) {
        perror("permit_echo: listen");
        return 1;
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener};
    epoll_ctl(ep, EPOLL_CTL_ADD, listener, &ev);
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        if (n < 0 && errno == EINTR)
            continue;
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) {
                int client;
                while ((client = accept4(listener, NULL, NULL, SOCK_CLOEXEC)) >= 0) {
                    if (client >= MAX_FD) {
                        close(client);
                        continue;
                    }
                    conns[client] = calloc(1, sizeof(struct conn));
                    struct epoll_event cev = {.events = EPOLLIN, .data.fd = client};
                    epoll_ctl(ep, EPOLL_CTL_ADD, client, &cev);
                }
                continue;
            }
            struct conn *c = conns[fd];
            ssize_t got = read(fd, c->in + c->len, sizeof c->in - c->len);
            if (got <= 0 || (c->len += got, answer(fd, c) < 0)) {
                close(fd);
                free(c);
                conns[fd] = NULL;
            }
        }
    }
}
