/* Small helpers shared by the cmocka tests. */
#ifndef SP_TESTUTIL_H
#define SP_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "shardplane/config.h"
#include "tmpdir.h"

/* Defined in a build AddressSanitizer instruments (GCC says so with
 * __SANITIZE_ADDRESS__, clang only through __has_feature): there the
 * tests' bounds on time and memory are looser or not measured. */
#if defined(__SANITIZE_ADDRESS__)
#define SP_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SP_TEST_ASAN 1
#endif
#endif

/* Exit status that ctest (SKIP_RETURN_CODE) reports as "skipped". */
#define SP_TEST_SKIP_RC 77

/* Prints "SKIPPED: <why>" and returns SP_TEST_SKIP_RC; use as
 * `return sp_test_skip("no CUDA device");` from main. */
int sp_test_skip(const char *why);

/* For tests of the GPU paths: 0 when libshardplane was built with CUDA and
 * a CUDA device is present; otherwise prints "SKIPPED: <why>" and returns
 * SP_TEST_SKIP_RC, for main to return. */
int sp_test_need_cuda_device(void);

/* In a file that includes <cuda_runtime_api.h>: fails the test, naming the
 * call and CUDA's error, unless the CUDA runtime call succeeds. */
#define SP_TEST_CU(call)                                   \
  do {                                                     \
    cudaError_t e_ = (call);                               \
    if (e_ != cudaSuccess)                                 \
      fail_msg("%s:%d: %s: %s", __FILE__, __LINE__, #call, \
               cudaGetErrorString(e_));                    \
  } while (0)

/* Deterministic generator (splitmix64) so failures reproduce. */
typedef struct sp_test_rng {
  uint64_t s;
} sp_test_rng;
uint64_t sp_test_rng_next(sp_test_rng *r);
/* Uniform in [0, n); n > 0. */
uint64_t sp_test_rng_below(sp_test_rng *r, uint64_t n);

/* Creates a fresh directory under $TMPDIR (or /tmp); returns a malloc'd path
 * the caller frees (and removes with sp_test_rmtree, tmpdir.h). Aborts the
 * test on failure. */
char *sp_test_mkdtemp(void);
/* Joins dir and name into a malloc'd path. */
char *sp_test_path(const char *dir, const char *name);
/* The path of the first file in dir (in readdir's order) whose name ends
 * in suffix, malloc'd; NULL when there is none or dir cannot be read. */
char *sp_test_first_file(const char *dir, const char *suffix);
/* The whole file as a malloc'd NUL-terminated string (the caller frees).
 * Aborts the test on failure. */
char *sp_test_read_file(const char *path);
/* Writes len bytes to path, replacing it. Aborts the test on failure. */
void sp_test_write_file(const char *path, const void *data, size_t len);
/* cmocka group fixtures for a test program whose tests share one fresh
 * directory: setup makes it (sp_test_mkdtemp) into sp_test_dir, teardown
 * removes it and frees the path. */
extern char *sp_test_dir;
int sp_test_dir_setup(void **state);
int sp_test_dir_teardown(void **state);

/* Runs cmd with /bin/sh: its exit status (-1 when it did not exit
 * normally) and its whole stdout in *out (malloc'd; the caller frees).
 * Aborts the test when cmd cannot be run (sp_test_capture, capture.h). */
int sp_test_shell(const char *cmd, char **out);

/* Starts argv (NULL-terminated; argv[0] a path) with stdout and stderr
 * in the files out and err (created or truncated). Aborts the test if it
 * cannot start. */
int sp_test_spawn_logged(const char *out, const char *err, char *const *argv);
/* Waits for pid: its exit status, 128 + the signal that ended it, or -1
 * after timeout_s (then it is SIGKILLed and reaped). */
int sp_test_wait_exit(int pid, double timeout_s);

/* A "Key:  N kB" line of /proc/self/status (VmRSS, VmHWM): N, or 0 when
 * there is none. */
uint64_t sp_test_proc_status_kib(const char *key);

/* /proc/PID/WHAT ("cmdline", "environ": NUL-separated) read into buf
 * (cap bytes, NUL-terminated): its length, or -1 when it cannot be read
 * (the process is gone). */
long sp_test_proc_file(int pid, const char *what, char *buf, size_t cap);
/* The pids of parent's children alive now, at most cap of them in out
 * (/proc order); their count. */
size_t sp_test_children(int parent, int *out, size_t cap);

/* Sleeps ms milliseconds (the whole time, across signals). Time is read
 * with sp_clock_s() (common/base/clock.h). */
void sp_test_sleep_ms(unsigned ms);

/* Fails the test unless got and want (n float32 each, a GPU's and the
 * CPU's) hold the same bits, NaNs included, naming `what` and the first
 * element that differs. */
void sp_test_same_f32(const char *what, const float *got, const float *want,
                      size_t n);

#endif
