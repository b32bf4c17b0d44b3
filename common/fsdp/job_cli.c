#include "job_cli.h"

#include <stdlib.h>
#include <string.h>

struct option *sp_job_cli_options(const struct option *own, size_t n_own) {
  size_t n_job = 0;
  while (sp_job_flags[n_job].name != NULL) n_job++;
  struct option *o = calloc(n_own + n_job + 1, sizeof *o);
  if (o == NULL) return NULL;
  memcpy(o, own, n_own * sizeof *o);
  for (size_t i = 0; i < n_job; i++)
    o[n_own + i] = (struct option){sp_job_flags[i].name,
                                   sp_job_flags[i].has_arg ? required_argument
                                                           : no_argument,
                                   NULL, SP_JOB_OPT_BASE + (int)i};
  return o;
}

int sp_job_cli_record(sp_job_cli *cli, int c, const char *value) {
  if (cli->n == cli->cap) {
    size_t cap = cli->cap ? cli->cap * 2 : 16;
    void *p = realloc(cli->items, cap * sizeof *cli->items);
    if (p == NULL) return SP_ENOMEM;
    cli->items = p;
    cli->cap = cap;
  }
  cli->items[cli->n].flag = c - SP_JOB_OPT_BASE;
  cli->items[cli->n].value = value;
  cli->n++;
  return 0;
}

int sp_job_cli_apply(sp_job_cli *cli, const char *job_path, sp_job *job,
                     sp_diag *diag) {
  if (job_path != NULL) {
    int rc = sp_job_load_file(job_path, job, diag);
    if (rc != 0) return rc == SP_EINVAL ? SP_EFORMAT : rc;
  }
  for (size_t i = 0; i < cli->n; i++) {
    int rc = sp_job_apply_flag(job, sp_job_flags[cli->items[i].flag].name,
                               cli->items[i].value, diag);
    if (rc != 0) return rc;
  }
  return 0;
}

void sp_job_cli_free(sp_job_cli *cli) {
  free(cli->items);
  memset(cli, 0, sizeof *cli);
}
