/* `shardplane analyze`: reads a coordinator's dump (a file it wrote on a
 * stall or an abort, or a live one through GetDump) and prints where the
 * job first went wrong (analyze_core.c). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "analyze.h"
#include "base/flag.h"
#include "base/json.h"
#include "cli.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "shardplane/v1/coordinator.pb-c.h"

static const subcmd k_analyze = {
    "analyze [DUMP] [--last N] [options]",
    "The first divergence of every communicator in a dump: the first\n"
    "collective (by its seq) where the members issued different\n"
    "collectives, where some issued it and others did not, or where not\n"
    "every member completed it, naming the ranks, the unit and its module;\n"
    "then each rank's last event, or why it sent no record (with ranks\n"
    "missing, no divergence is not called healthy: they may be the ones\n"
    "that parted). DUMP is a file the coordinator wrote to its\n"
    "--dump-dir; without one, the coordinator (--coordinator) takes a dump\n"
    "now (GetDump; --last N events per rank, default all).\n\n"
    "  --last N                     a live dump: the last N events per rank\n"
    "\nexit code 5: the dump shows a divergence (0: none).\n\n",
    0, 1, "the dump shows a divergence"};

enum { OPT_A_LAST = 256 };

typedef struct analyze_args {
  const char *cmd;
  long long last;
} analyze_args;

static int analyze_opt(void *ctx, int c, const char *arg) {
  analyze_args *a = ctx;
  sp_diag d = {{0}};
  if (c != OPT_A_LAST) return -1;
  /* 0 would be the coordinator's "all": not what --last 0 says */
  if (sp_flag_int("--last", arg, 1, UINT32_MAX, &a->last, &d) != 0) {
    sp_cli_error(a->cmd, "%s", d.msg);
    return -1;
  }
  return 0;
}

static int report(sp_remote *r, const char *buf, size_t len, const char *origin,
                  const char *const *fqns, size_t n_fqns) {
  sp_analysis an;
  sp_diag d = {{0}};
  int rc = sp_analyze(buf, len, origin, fqns, n_fqns, &an, &d);
  if (rc != 0) {
    sp_cli_error(r->cmd, "%s", d.msg[0] ? d.msg : sp_strerror(rc));
    return SP_EXIT_FAILURE;
  }
  int ec = an.n_findings > 0 ? SP_EXIT_ALERT : SP_EXIT_OK;
  if (r->json) {
    if (sp_render_json_out(sp_analysis_json(&an)) != 0) ec = SP_EXIT_FAILURE;
  } else {
    sp_analysis_print(&an, stdout);
  }
  sp_analysis_free(&an);
  return ec;
}

int sp_cmd_analyze(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "analyze");
  analyze_args a = {.cmd = r.cmd};
  const struct option own[] = {{"last", required_argument, NULL, OPT_A_LAST}};
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_analyze, argc, argv, own, 1, analyze_opt,
                                &a, &first, &n);
  if (ec != PROCEED) return ec;
  if (n == 1 && a.last > 0) {
    /* a file holds what the coordinator wrote: --last cannot trim it */
    sp_cli_error(r.cmd, "--last is for a live dump, not the file %s",
                 argv[first]);
    sp_cli_try_help(r.cmd);
    return SP_EXIT_USAGE;
  }
  if (n == 1) {
    const char *path = argv[first];
    char *buf = NULL;
    size_t len = 0;
    sp_diag d = {{0}};
    if (sp_json_read_file(path, SP_DUMP_MAX_BYTES, &buf, &len, &d) != 0) {
      sp_cli_error(r.cmd, "%s", d.msg);
      return SP_EXIT_FAILURE;
    }
    ec = report(&r, buf, len, path, NULL, 0);
    free(buf);
    return sp_remote_finish(&r, ec);
  }
  /* the units' module names, from the plan; without them the report
   * names units by number */
  Shardplane__V1__GetPlanRequest pq = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  ProtobufCMessage *pm = NULL;
  sp_rpc_status pst;
  const char **fqns = NULL;
  size_t n_fqns = 0;
  ec = sp_remote_call_status(&r, SP_COORD_PATH("GetPlan"), &pq.base,
                             &shardplane__v1__plan__descriptor, r.timeout_ms,
                             &pm, &pst);
  if (ec != PROCEED) return sp_remote_finish(&r, ec);
  if (pst.code == SP_RPC_OK) {
    const Shardplane__V1__Plan *pl = (const Shardplane__V1__Plan *)pm;
    /* indices are the plan's own, 0..n-1; one past that is not a unit */
    n_fqns = pl->n_units;
    fqns = calloc(n_fqns + 1, sizeof *fqns);
    for (size_t i = 0; fqns != NULL && i < pl->n_units; i++)
      if (pl->units[i]->index < n_fqns)
        fqns[pl->units[i]->index] = pl->units[i]->module_fqn;
    if (fqns == NULL) n_fqns = 0;
  }
  Shardplane__V1__GetDumpRequest q = SHARDPLANE__V1__GET_DUMP_REQUEST__INIT;
  q.last_n = (uint32_t)a.last;
  ProtobufCMessage *m;
  ec = sp_remote_call(&r, SP_COORD_PATH("GetDump"), &q.base,
                      &shardplane__v1__get_dump_response__descriptor, &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__GetDumpResponse *g =
        (const Shardplane__V1__GetDumpResponse *)m;
    char origin[300];
    snprintf(origin, sizeof origin, "the dump of %s", r.addr);
    ec = report(&r, (const char *)g->json.data, g->json.len, origin, fqns,
                n_fqns);
    sp_remote_free_msg(m);
  }
  free(fqns);
  sp_remote_free_msg(pm);
  return sp_remote_finish(&r, ec);
}
