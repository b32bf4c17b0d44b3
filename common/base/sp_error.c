#include "sp_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *sp_strerror(int err) {
  if (err == 0) return "success";
  switch (err) {
#define SP_ERR_CASE(name, val, msg) \
  case (val): return (msg);
    SP_ERRNO_MAP(SP_ERR_CASE)
#undef SP_ERR_CASE
  }
  return "unknown error";
}

const char *sp_err_name(int err) {
  if (err == 0) return "OK";
  switch (err) {
#define SP_ERR_NAME(name, val, msg) \
  case (val): return "SP_" #name;
    SP_ERRNO_MAP(SP_ERR_NAME)
#undef SP_ERR_NAME
  }
  return "SP_EUNKNOWN";
}

int sp_diag_set(sp_diag *d, int err, const char *fmt, ...) {
  if (d == NULL) return err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->msg, sizeof d->msg, fmt, ap);
  va_end(ap);
  return err;
}

int sp_diag_prefix(sp_diag *d, int err, const char *fmt, ...) {
  if (d == NULL) return err;
  char prefix[SP_DIAG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  char old[SP_DIAG_MAX];
  memcpy(old, d->msg, sizeof old);
  old[sizeof old - 1] = '\0';
  /* truncation is acceptable for a diagnostic line; using the result
   * tells gcc so */
  if (snprintf(d->msg, sizeof d->msg, "%s: %s", prefix, old) < 0)
    d->msg[0] = '\0';
  return err;
}
