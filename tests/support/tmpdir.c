#include "tmpdir.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/sp_error.h"

int sp_test_tmpdir(const char *base, const char *prefix, char *out,
                   size_t cap) {
  if (base == NULL) {
    base = getenv("TMPDIR");
    if (base == NULL || base[0] == '\0') base = "/tmp";
  }
  int n = snprintf(out, cap, "%s/%s-XXXXXX", base, prefix);
  if (n < 0 || (size_t)n >= cap) {
    if (cap > 0) out[0] = '\0';
    return SP_ETOOBIG;
  }
  return mkdtemp(out) != NULL ? 0 : SP_EIO;
}

static int rm_entry(const char *p, const struct stat *sb, int flag,
                    struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(p);
}

void sp_test_rmtree(const char *dir) {
  nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}
