/* Command-line handling of job flags, shared by the tools: getopt_long
 * tables that include every sp_job_flags entry, and the rule that a job
 * file is applied first and the flags after it, in order. */
#ifndef SP_JOB_CLI_H
#define SP_JOB_CLI_H

#include <getopt.h>
#include <stddef.h>

#include "job.h"

/* getopt_long returns SP_JOB_OPT_BASE + i for sp_job_flags[i]. */
#define SP_JOB_OPT_BASE 1000

/* The tool's own options (n_own entries, no terminator needed) followed by
 * the job flags and a terminator. malloc'd; NULL on ENOMEM. */
struct option *sp_job_cli_options(const struct option *own, size_t n_own);

/* Job flags in command-line order, applied after the job file. */
typedef struct sp_job_cli {
  struct {
    int flag;
    const char *value; /* points into argv */
  } * items;
  size_t n, cap;
} sp_job_cli;

/* Records getopt's return value c (>= SP_JOB_OPT_BASE) and its optarg. */
int sp_job_cli_record(sp_job_cli *cli, int c, const char *optarg_value);
/* Loads job_path (may be NULL) into job, then applies the recorded flags.
 * Errors name the file or the flag in diag; SP_EINVAL means bad usage. */
int sp_job_cli_apply(sp_job_cli *cli, const char *job_path, sp_job *job,
                     sp_diag *diag);
void sp_job_cli_free(sp_job_cli *cli);
/* The recorded --wrap-type and --wrap-module values against the model:
 * SP_EINVAL, naming the flag, the value and the model's modules, for a
 * target the model does not have. */
int sp_job_cli_check_model(const sp_job_cli *cli, const sp_model *model,
                           sp_diag *diag);

#endif
