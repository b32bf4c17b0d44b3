/* `shardplane run` serves its job with tokens like any coordinator: a
 * worker token for its ranks and an admin token for the operator, made
 * afresh for every run and removed when it ends. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth/token.h"
#include "cli.h"
#include "run_auth.h"

#define RUN "run"

static int path_in(char *out, const char *dir, const char *name) {
  int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
  return n > 0 && n < PATH_MAX ? 0 : -1;
}

static int one_token(const sp_run_creds *c, int role, const char *name,
                     const char *path) {
  char token[SP_AUTH_TOKEN_LEN + 1];
  sp_diag d = {{0}};
  int rc = sp_auth_token_new(token, &d);
  if (rc == 0) rc = sp_auth_token_write(path, token, &d);
  if (rc == 0) rc = sp_auth_file_add(c->token_file, token, role, name, &d);
  memset(token, 0, sizeof token);
  if (rc == 0) return 0;
  sp_cli_error(RUN, "cannot make the job's %s token: %s",
               sp_auth_role_name(role), d.msg);
  return -1;
}

int sp_run_creds_make(const char *base, sp_run_creds *c) {
  memset(c, 0, sizeof *c);
  if (mkdir(base, 0755) != 0 && errno != EEXIST) {
    sp_cli_error(RUN, "cannot create %s: %s", base, strerror(errno));
    return -1;
  }
  char tmpl[PATH_MAX];
  if (snprintf(tmpl, sizeof tmpl, "%s/auth-XXXXXX", base) >= PATH_MAX ||
      mkdtemp(tmpl) == NULL) {
    sp_cli_error(RUN, "cannot create a directory in %s: %s", base,
                 strerror(errno));
    return -1;
  }
  snprintf(c->dir, sizeof c->dir, "%s", tmpl);
  if (path_in(c->token_file, c->dir, "tokens") != 0 ||
      path_in(c->worker_token, c->dir, "worker.token") != 0 ||
      path_in(c->admin_token, c->dir, "admin.token") != 0 ||
      path_in(c->reader_token, c->dir, "reader.token") != 0 ||
      one_token(c, SP_ROLE_WORKER, "run-worker", c->worker_token) != 0 ||
      one_token(c, SP_ROLE_ADMIN, "run-admin", c->admin_token) != 0 ||
      one_token(c, SP_ROLE_READER, "run-reader", c->reader_token) != 0) {
    sp_run_creds_remove(c);
    return -1;
  }
  return 0;
}

void sp_run_creds_remove(const sp_run_creds *c) {
  if (c->dir[0] == '\0') return;
  const char *files[] = {c->token_file, c->worker_token, c->admin_token,
                         c->reader_token};
  for (size_t i = 0; i < 4; i++)
    if (files[i][0] != '\0') unlink(files[i]);
  rmdir(c->dir);
}
