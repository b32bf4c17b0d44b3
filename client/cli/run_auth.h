/* The credentials `shardplane run` makes for its own job (run_auth.c). */
#ifndef SP_CLI_RUN_AUTH_H
#define SP_CLI_RUN_AUTH_H

#include <limits.h>

typedef struct sp_run_creds {
  char dir[PATH_MAX];          /* mode 0700; "" until made */
  char token_file[PATH_MAX];   /* the coordinator's: hashes only */
  char worker_token[PATH_MAX]; /* the workers' token, mode 0600 */
  char admin_token[PATH_MAX];  /* for the operator's commands, mode 0600 */
  char reader_token[PATH_MAX]; /* the dashboard's and /metrics', 0600 */
} sp_run_creds;

/* Makes a fresh directory under `base` (created if absent), a worker, an
 * admin and a reader token in files of their own, and the token file that
 * lists them. 0, or -1 with the message printed. */
int sp_run_creds_make(const char *base, sp_run_creds *c);
/* Removes the files and the directory: the tokens are of no use once the
 * job's coordinator is gone. */
void sp_run_creds_remove(const sp_run_creds *c);

#endif
