/* Command-line flag values, checked the same way by every program, so
 * that every error reads `--steps "-3": expected an integer in
 * [1, 1000000000]`: the flag (written with its dashes), the value and what
 * is allowed. Each returns 0, or SP_EINVAL with that message in diag. */
#ifndef SP_FLAG_H
#define SP_FLAG_H

#include <stddef.h>

#include "sp_error.h"

/* Sets `FLAG "VALUE": expected <fmt...>` in diag; returns SP_EINVAL. */
int sp_flag_fail(sp_diag *diag, const char *flag, const char *value,
                 const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A decimal integer in [min, max]. */
int sp_flag_int(const char *flag, const char *value, long long min,
                long long max, long long *out, sp_diag *diag);
/* A finite number >= min. */
int sp_flag_number(const char *flag, const char *value, double min, double *out,
                   sp_diag *diag);
/* One of names[0..n) (case-insensitive; NULL entries are skipped):
 * *index is its index. */
int sp_flag_choice(const char *flag, const char *value,
                   const char *const *names, size_t n, size_t *index,
                   sp_diag *diag);
/* Any non-empty value; `what` says what it names ("a directory"). */
int sp_flag_text(const char *flag, const char *value, const char *what,
                 sp_diag *diag);

/* After the one line that says what is wrong with a command line: "try
 * 'PROG --help'" to stderr (prog: "shardplane run"). The whole help
 * there buried that line under a hundred others. */
void sp_flag_try_help(const char *prog);

#endif
