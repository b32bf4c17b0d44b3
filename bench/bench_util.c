#include "bench_util.h"

#include <poll.h>
#include <string.h>
#include <unistd.h>

int sp_bench_read_line(int fd, char *line, size_t cap, int timeout_ms) {
  size_t have = 0;
  line[0] = '\0';
  while (have < cap - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0) return -1;
    ssize_t n = read(fd, line + have, cap - 1 - have);
    if (n <= 0) return -1;
    have += (size_t)n;
    line[have] = '\0';
    if (strchr(line, '\n') != NULL) return 0;
  }
  return -1;
}
