#include "capture.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "base/sp_error.h"

int sp_test_capture(const char *cmd, char **out, int *status) {
  *out = NULL;
  FILE *p = popen(cmd, "r");
  if (p == NULL) return SP_EIO;
  size_t cap = 1 << 16, len = 0, n;
  char *buf = malloc(cap);
  while (buf != NULL && (n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
    len += n;
    if (cap - len < 2) {
      char *grown = realloc(buf, cap *= 2);
      if (grown == NULL) free(buf);
      buf = grown;
    }
  }
  /* waited for even when memory ran out: no zombie, no open pipe */
  int st = pclose(p);
  if (buf == NULL) return SP_ENOMEM;
  buf[len] = '\0';
  *out = buf;
  *status = st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return 0;
}
