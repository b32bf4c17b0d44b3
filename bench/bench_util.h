/* Helpers shared by the benchmarks. */
#ifndef SP_BENCH_UTIL_H
#define SP_BENCH_UTIL_H

#include <stddef.h>

/* Reads from fd until a newline, at most cap-1 bytes, waiting at most
 * timeout_ms for each read; line is NUL-terminated. Returns 0 when a whole
 * line arrived, -1 otherwise (timeout, EOF, error). Used to learn the port
 * a server child prints once it listens. */
int sp_bench_read_line(int fd, char *line, size_t cap, int timeout_ms);

#endif
