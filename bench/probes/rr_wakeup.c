/* What a thread wake-up costs a small request/reply over loopback TCP on this machine (issue 21).

   A parent (client) and a forked child (server) exchange N request/replies of one 64 KiB block out of
   a 4 MiB buffer of pseudo-random bytes: a 16-byte request (the block's index), the block as reply.
   MODE says how each side waits for its bytes:
     block   both sleep in recv (MSG_WAITALL)
     client  the client polls (recv with MSG_DONTWAIT in a loop), the server sleeps
     both    both poll
     yield   both poll, yielding the core (sched_yield) after every empty poll, as llmdd.tcp.spin_us does
   Run it as is (the scheduler places the two processes) and under `taskset -c 0` (one core: a wake-up
   needs no interrupt to another core) to see the cost of a cross-core wake-up.  The client checks the
   last reply's bytes against the buffer; p50 / p99 in microseconds on stdout.

     gcc -O2 -o /tmp/rr_wakeup bench/probes/rr_wakeup.c && /tmp/rr_wakeup 3000 block
*/
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 65536
#define BLOCKS 64

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Fill buf with len bytes from fd, sleeping in the kernel or polling (2: yielding between polls); 0 at the
   end of the stream. */
static int take(int fd, char *buf, size_t len, int poll) {
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(fd, buf + got, len - got, poll ? MSG_DONTWAIT : MSG_WAITALL);
        if (r == 0)
            return 0;
        if (r > 0)
            got += (size_t)r;
        else if (poll == 2)
            sched_yield();
    }
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s N block|client|both|yield\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]);
    int yield = strcmp(argv[2], "yield") == 0;
    int client_polls = strcmp(argv[2], "block") == 0 ? 0 : 1 + yield;
    int server_polls = strcmp(argv[2], "both") == 0 ? 1 : 2 * yield;
    char *buf = malloc((size_t)BLOCK * BLOCKS), *dst = malloc(BLOCK);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < (size_t)BLOCK * BLOCKS; i++) {   /* xorshift: no constant fill */
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        buf[i] = (char)x;
    }
    int lst = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (bind(lst, (struct sockaddr *)&a, sizeof a) || listen(lst, 1) || getsockname(lst, (struct sockaddr *)&a, &alen)) {
        perror("listen");
        return 1;
    }
    pid_t child = fork();
    if (child == 0) {
        int c = accept(lst, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char q[16];
        while (take(c, q, sizeof q, server_polls)) {
            uint64_t i;
            memcpy(&i, q, 8);
            if (send(c, buf + (i % BLOCKS) * BLOCK, BLOCK, 0) != BLOCK)
                _exit(1);
        }
        _exit(0);
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (struct sockaddr *)&a, sizeof a)) {
        perror("connect");
        return 1;
    }
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double *us = malloc(sizeof(double) * n);
    uint64_t last = 0;
    for (int k = 0; k < n; k++) {
        char q[16] = {0};
        last = (uint64_t)k * 7 % BLOCKS;
        memcpy(q, &last, 8);
        double t0 = now_us();
        if (send(s, q, sizeof q, 0) != sizeof q || !take(s, dst, BLOCK, client_polls)) {
            fprintf(stderr, "server went away\n");
            return 1;
        }
        us[k] = now_us() - t0;
    }
    int same = memcmp(dst, buf + last * BLOCK, BLOCK) == 0;
    close(s);
    waitpid(child, NULL, 0);
    qsort(us, n, sizeof *us, by_value);
    printf("mode %s: p50 %.1f us p99 %.1f us (n %d, last reply %s)\n", argv[2], us[n / 2], us[n * 99 / 100], n,
           same ? "verified" : "WRONG");
    return same ? 0 : 1;
}
