/* A shell command's output, for tests and benchmarks that check or read
 * what a program prints. */
#ifndef SP_TEST_CAPTURE_H
#define SP_TEST_CAPTURE_H

/* Runs cmd with /bin/sh (popen) and reads its stdout to the end: 0, the
 * output in *out (malloc'd, NUL-terminated; the caller frees it) and the
 * exit status in *status (-1 when the command did not exit normally).
 * SP_EIO when it cannot be started, SP_ENOMEM; *out is NULL then. stderr
 * stays the caller's unless cmd says 2>&1. */
int sp_test_capture(const char *cmd, char **out, int *status);

#endif
