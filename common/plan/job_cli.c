#include "job_cli.h"
#include "base/flag.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct option *sp_job_cli_options(const struct option *own, size_t n_own) {
  size_t n_job = 0;
  while (sp_job_flags[n_job].name != NULL) n_job++;
  struct option *o = calloc(n_own + n_job + 1, sizeof *o);
  if (o == NULL) return NULL;
  memcpy(o, own, n_own * sizeof *o);
  for (size_t i = 0; i < n_job; i++)
    o[n_own + i] = (struct option){
        sp_job_flags[i].name,
        sp_job_flags[i].has_arg ? required_argument : no_argument, NULL,
        SP_JOB_OPT_BASE + (int)i};
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

/* Up to `max` distinct module types (or FQNs) of the model, quoted and
 * comma-separated, "..." when there are more. */
static void list_modules(const sp_model *m, bool types, size_t max, char *out,
                         size_t cap) {
  size_t len = 0, shown = 0;
  out[0] = '\0';
  for (size_t i = 0; i < m->n_modules && len < cap; i++) {
    const char *s = types ? m->modules[i].type : m->modules[i].fqn;
    if (s[0] == '\0') continue; /* the root has no FQN */
    bool seen = false;
    for (size_t k = 0; types && k < i; k++)
      if (strcmp(m->modules[k].type, s) == 0) seen = true;
    if (seen) continue;
    if (shown == max) {
      snprintf(out + len, cap - len, ", ...");
      return;
    }
    int w = snprintf(out + len, cap - len, "%s\"%s\"", shown ? ", " : "", s);
    if (w < 0) return;
    len += (size_t)w;
    shown++;
  }
}

int sp_job_cli_check_model(const sp_job_cli *cli, const sp_model *model,
                           sp_diag *diag) {
  for (size_t i = 0; i < cli->n; i++) {
    const char *name = sp_job_flags[cli->items[i].flag].name;
    const char *v = cli->items[i].value;
    bool type = strcmp(name, "wrap-type") == 0;
    if (!type && strcmp(name, "wrap-module") != 0) continue;
    bool found = false;
    for (size_t k = 0; k < model->n_modules && !found; k++)
      found =
          strcmp(type ? model->modules[k].type : model->modules[k].fqn, v) == 0;
    if (found) continue;
    char list[512], flag[64];
    list_modules(model, type, 12, list, sizeof list);
    snprintf(flag, sizeof flag, "--%s", name);
    return sp_flag_fail(diag, flag, v, "%s of model %s: %s",
                        type ? "a module type" : "the FQN of a module",
                        model->name, list);
  }
  return 0;
}
