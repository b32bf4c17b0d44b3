#include "flag.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int sp_flag_fail(sp_diag *diag, const char *flag, const char *value,
                 const char *fmt, ...) {
  if (diag == NULL) return SP_EINVAL;
  char what[SP_DIAG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  /* truncation is fine for a diagnostic; using the result tells gcc so */
  if (snprintf(diag->msg, sizeof diag->msg, "%s \"%.200s\": expected %s", flag,
               value ? value : "", what) < 0)
    diag->msg[0] = '\0';
  return SP_EINVAL;
}

int sp_flag_int(const char *flag, const char *value, long long min,
                long long max, long long *out, sp_diag *diag) {
  char *end;
  errno = 0;
  long long v = value ? strtoll(value, &end, 10) : 0;
  /* strtoll takes leading blanks and a '+': a flag value does not */
  if (value == NULL ||
      !(value[0] == '-' || (value[0] >= '0' && value[0] <= '9')) ||
      *end != '\0' || errno != 0 || v < min || v > max)
    return sp_flag_fail(diag, flag, value, "an integer in [%lld, %lld]", min,
                        max);
  *out = v;
  return 0;
}

int sp_flag_number(const char *flag, const char *value, double min, double *out,
                   sp_diag *diag) {
  char *end;
  double v = value && *value && *value != ' ' ? strtod(value, &end) : NAN;
  if (isnan(v) || *end != '\0' || !isfinite(v) || v < min)
    return sp_flag_fail(diag, flag, value, "a finite number >= %g", min);
  *out = v;
  return 0;
}

int sp_flag_choice(const char *flag, const char *value,
                   const char *const *names, size_t n, size_t *index,
                   sp_diag *diag) {
  for (size_t i = 0; value && i < n; i++)
    if (names[i] != NULL && strcasecmp(value, names[i]) == 0) {
      *index = i;
      return 0;
    }
  char list[512];
  size_t len = 0;
  list[0] = '\0';
  for (size_t i = 0; i < n && len < sizeof list; i++) {
    if (names[i] == NULL) continue;
    int w = snprintf(list + len, sizeof list - len, "%s%s", len ? ", " : "",
                     names[i]);
    if (w < 0) break;
    len += (size_t)w;
  }
  return sp_flag_fail(diag, flag, value, "one of %s", list);
}

int sp_flag_text(const char *flag, const char *value, const char *what,
                 sp_diag *diag) {
  if (value == NULL || value[0] == '\0')
    return sp_flag_fail(diag, flag, value, "%s", what);
  return 0;
}

void sp_flag_try_help(const char *prog) {
  fprintf(stderr, "try '%s --help'\n", prog);
}
