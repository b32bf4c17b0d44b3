/* `shardplane status` and `shardplane ranks`: the job and every rank's
 * training state, as the coordinator sees them. */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "flight_fmt.h"
#include "plan/state.h"
#include "lib/session/plan_wire.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* ------------------------------------------------------------------ */
/* status                                                              */
/* ------------------------------------------------------------------ */

static const subcmd k_status = {
    "status [options]",
    "The job at a glance: model, job, plan version, the job's state and\n"
    "progress (step of total, steps/s, loss, time left), its verdict when\n"
    "it failed, how many ranks are in each state, and the alerts raised so\n"
    "far, each with its time (UTC, as watch prints it), kind, culprits\n"
    "and victims (shardplane why: the verdict in full).\n\n",
    0, 0, NULL};

/* GetJob, with the job converted for the shared job renderer. */
int sp_remote_get_job(sp_remote *r, Shardplane__V1__GetJobResponse **out,
                      sp_job *job) {
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  ProtobufCMessage *m;
  int ec = sp_remote_call(r, SP_COORD_PATH("GetJob"), &q.base,
                          &shardplane__v1__get_job_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  Shardplane__V1__GetJobResponse *j = (Shardplane__V1__GetJobResponse *)m;
  if (j->job == NULL || sp_wire_job(j->job, job) != 0) {
    sp_remote_free_msg(j);
    sp_cli_error(r->cmd, "the coordinator's answer has no job");
    return SP_EXIT_FAILURE;
  }
  *out = j;
  return SP_EXIT_OK;
}

/* proto3 leaves an all-zero summary out of the message */
static const Shardplane__V1__RankSummary *rank_summary(
    const Shardplane__V1__GetJobResponse *j) {
  static const Shardplane__V1__RankSummary empty =
      SHARDPLANE__V1__RANK_SUMMARY__INIT;
  return j->ranks != NULL ? j->ranks : &empty;
}

static json_t *rank_summary_json(const Shardplane__V1__RankSummary *s) {
  json_t *by_state = json_object();
  for (size_t i = 1; i < s->n_by_root_state; i++)
    json_object_set_new(by_state, sp_state_name(SP_MACHINE_ROOT, (int)i),
                        json_integer(s->by_root_state[i]));
  return json_pack("{s:i,s:i,s:i,s:i,s:o}", "attached", (int)s->attached,
                   "lost", (int)s->lost, "detached", (int)s->detached,
                   "never_attached", (int)s->never_attached, "by_root_state",
                   by_state);
}

static void print_status(const sp_remote *r,
                         const Shardplane__V1__GetJobResponse *j,
                         const sp_job *job) {
  char up[32];
  sp_remote_format_duration(j->uptime_ms, up, sizeof up);
  printf("coordinator %s, up %s\n", r->addr, up);
  printf("model       %s: %u modules, %u parameters, %" PRId64
         " elements, %u buffers\n",
         j->model_name, j->n_modules, j->n_params, j->total_numel,
         j->n_buffers);
  printf("job         ");
  sp_render_job_line(job, (sp_strategy)j->effective_strategy);
  printf("\nplan        version %s, %u units\n", j->plan_version, j->n_units);
  char prog[256];
  sp_remote_progress_words(j->progress, prog, sizeof prog);
  printf("state       %s: %s\n", sp_remote_job_state_name(j->state), prog);
  if (j->verdict[0] != '\0') printf("verdict     %s\n", j->verdict);
  const Shardplane__V1__RankSummary *s = rank_summary(j);
  printf("ranks       %u attached", s->attached);
  bool any = false;
  for (size_t i = 1; i < s->n_by_root_state; i++)
    if (s->by_root_state[i] > 0) {
      printf("%s%u %s", any ? ", " : " (", s->by_root_state[i],
             sp_state_name(SP_MACHINE_ROOT, (int)i));
      any = true;
    }
  printf("%s, %u lost, %u detached, %u never attached\n", any ? ")" : "",
         s->lost, s->detached, s->never_attached);
  sp_remote_print_quorum(stdout, "replicas", 12, j->quorum);
  printf("alerts      %u", j->alerts);
  if (j->n_recent_alerts > 0)
    printf(" (the last %zu below, times UTC)", j->n_recent_alerts);
  printf("\n");
  uint64_t start_us = sp_remote_coord_start_us(j->uptime_ms);
  for (size_t i = 0; i < j->n_recent_alerts; i++) {
    const Shardplane__V1__Alert *a = j->recent_alerts[i];
    char when[32];
    sp_flight_time(sp_remote_coord_wall_us(start_us, a->time_ms), when,
                   sizeof when);
    printf("  %s  rank %u ", when, a->rank);
    sp_remote_print_alert(stdout, a);
    putchar('\n');
  }
}

static int status_json(const sp_remote *r,
                       const Shardplane__V1__GetJobResponse *j,
                       const sp_job *job) {
  json_t *alerts = json_array();
  uint64_t start_us = sp_remote_coord_start_us(j->uptime_ms);
  for (size_t i = 0; i < j->n_recent_alerts; i++) {
    const Shardplane__V1__Alert *a = j->recent_alerts[i];
    json_t *o = sp_remote_alert_json(a);
    /* as watch's time_us: on the wall clock */
    json_object_set_new(o, "time_us",
                        json_integer((json_int_t)sp_remote_coord_wall_us(
                            start_us, a->time_ms)));
    json_array_append_new(alerts, o);
  }
  json_t *root =
      json_pack("{s:s,s:I,s:{s:s,s:i,s:i,s:i,s:I},s:s,s:i,s:o,s:o,s:i,s:o}",
                "coordinator", r->addr, "uptime_ms", (json_int_t)j->uptime_ms,
                "model", "name", j->model_name, "modules", (int)j->n_modules,
                "params", (int)j->n_params, "buffers", (int)j->n_buffers,
                "elements", (json_int_t)j->total_numel, "plan_version",
                j->plan_version, "units", (int)j->n_units, "job",
                sp_render_job_json(job, (sp_strategy)j->effective_strategy, 0),
                "ranks", rank_summary_json(rank_summary(j)), "alerts",
                (int)j->alerts, "recent_alerts", alerts);
  if (root != NULL) {
    json_object_set_new(root, "state",
                        json_string(sp_remote_job_state_name(j->state)));
    json_object_set_new(root, "verdict", json_string(j->verdict));
    json_object_set_new(root, "progress", sp_remote_progress_json(j->progress));
    json_object_set_new(root, "quorum", sp_remote_quorum_json(j->quorum));
  }
  return sp_render_json_out(root) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}

int sp_cmd_status(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "status");
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_status, argc, argv, NULL, 0, NULL, NULL,
                                &first, &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__GetJobResponse *j = NULL;
  sp_job job;
  sp_job_init(&job);
  ec = sp_remote_get_job(&r, &j, &job);
  if (ec == SP_EXIT_OK) {
    if (r.json)
      ec = status_json(&r, j, &job);
    else
      print_status(&r, j, &job);
  }
  sp_remote_free_msg(j);
  sp_job_clear(&job);
  return sp_remote_finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* ranks                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_ranks = {
    "ranks [--unit-states] [options]",
    "Every rank: attach status, host, pid, device, step, root training\n"
    "state, last collective, when it was last heard from, alerts.\n\n"
    "STEP is the step the rank is in or last finished, numbered from 1 as\n"
    "in the worker's \"step K/N\" lines (N once it is done; 0: none yet).\n"
    "LAST COLLECTIVE is \"#SEQ OP unit U DTYPE count C\": C is the\n"
    "collective's count, in elements per rank, as in the workers' errors:\n"
    "what each rank contributes to an all-gather (its shard) or receives\n"
    "from a reduce-scatter (its reduced shard), the whole buffer of an\n"
    "all-reduce or broadcast.\n"
    "P50/P90/P99 are the rank's step times (ms, from its own clock) over\n"
    "the recent steps; SCORE how much slower than the job's median it is\n"
    "(1.00: as fast; a straggler scores high). A rank that failed because\n"
    "a peer did is marked \"victim of rank R\".\n\n"
    "  --unit-states                also each unit's training state\n",
    0, 0, NULL};

enum { OPT_UNIT_STATES = 256 };

static int ranks_opt(void *ctx, int c, const char *arg) {
  (void)arg;
  if (c != OPT_UNIT_STATES) return -1;
  *(bool *)ctx = true;
  return 0;
}

static const char *rank_status_name(int v) {
  return sp_remote_enum_name(&shardplane__v1__rank_status__descriptor, v);
}

/* "IDLE 0-2,4-13; FORWARD 3": the units in each handle state. */
static void print_unit_states(const Shardplane__V1__RankInfo *k,
                              uint32_t *scratch) {
  printf("      units:");
  const char *sep = " ";
  for (int s = 1; s <= sp_state_max(SP_MACHINE_HANDLE); s++) {
    size_t n = 0;
    for (size_t u = 0; u < k->n_unit_states; u++)
      if (k->unit_states[u] == s) scratch[n++] = (uint32_t)u;
    if (n == 0) continue;
    printf("%s%s ", sep, sp_state_name(SP_MACHINE_HANDLE, s));
    sp_fmt_ranges(stdout, scratch, n);
    sep = "; ";
  }
  printf("\n");
}

/* Ranks per ListRanks call: with 100 units' states about 0.9 MB. */
#define RANKS_PAGE 4096u

/* "#SEQ OP unit U DTYPE count C", or "-" before the first collective. */
static void format_collective(const Shardplane__V1__RankInfo *k, char *buf,
                              size_t len) {
  const Shardplane__V1__Collective *c = k->last_collective;
  if (c == NULL) {
    snprintf(buf, len, "-");
    return;
  }
  snprintf(
      buf, len, "#%" PRIu64 " %s unit %u %s count %" PRIu64, c->seq,
      sp_remote_enum_name(&shardplane__v1__collective_op__descriptor, c->op),
      c->unit, sp_dtype_name(sp_wire_dtype(c->dtype)), c->count);
}

static void print_ranks(const Shardplane__V1__ListRanksResponse *l,
                        bool unit_states) {
  size_t max_units = 0;
  for (size_t i = 0; i < l->n_ranks; i++)
    if (l->ranks[i]->n_unit_states > max_units)
      max_units = l->ranks[i]->n_unit_states;
  uint32_t *scratch = calloc(max_units + 1, sizeof *scratch);
  /* as wide as the longest (a reduce-scatter's, deep into a job, is
   * wider than 40), so that the columns after it stay aligned */
  int coll_w = 40;
  for (size_t i = 0; i < l->n_ranks; i++) {
    char coll[128];
    format_collective(l->ranks[i], coll, sizeof coll);
    if ((int)strlen(coll) > coll_w) coll_w = (int)strlen(coll);
  }
  printf("%-9s %-14s %-20s %8s %-8s %8s %-18s %-*s %9s %6s %8s %8s %8s %6s\n",
         "RANK", "STATUS", "HOST", "PID", "DEVICE", "STEP", "STATE", coll_w,
         "LAST COLLECTIVE", "HEARD", "ALERTS", "P50", "P90", "P99", "SCORE");
  for (size_t i = 0; i < l->n_ranks;) {
    const Shardplane__V1__RankInfo *k = l->ranks[i];
    if (k->status == SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED) {
      /* a large world is mostly ranks that never came: one row per run */
      size_t j = i;
      while (j + 1 < l->n_ranks &&
             l->ranks[j + 1]->status ==
                 SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED &&
             l->ranks[j + 1]->rank == l->ranks[j]->rank + 1)
        j++;
      char range[32];
      if (j > i)
        snprintf(range, sizeof range, "%u-%u", k->rank, l->ranks[j]->rank);
      else
        snprintf(range, sizeof range, "%u", k->rank);
      printf("%-9s %s\n", range, rank_status_name(k->status));
      i = j + 1;
      continue;
    }
    char coll[128], heard[32];
    format_collective(k, coll, sizeof coll);
    sp_remote_format_duration(k->last_heard_ms_ago, heard, sizeof heard);
    char p50[16] = "-", p90[16] = "-", p99[16] = "-", score[16] = "-";
    /* no step timed yet: nothing to show, not zeros */
    if (k->step_p50_ms > 0) {
      snprintf(p50, sizeof p50, "%.1f", k->step_p50_ms);
      snprintf(p90, sizeof p90, "%.1f", k->step_p90_ms);
      snprintf(p99, sizeof p99, "%.1f", k->step_p99_ms);
    }
    if (k->straggler_score > 0)
      snprintf(score, sizeof score, "%.2f", k->straggler_score);
    printf("%-9u %-14s %-20s %8u %-8s %8" PRIu64
           " %-18s %-*s %9s %6u %8s %8s %8s %6s\n",
           k->rank, rank_status_name(k->status), k->host[0] ? k->host : "-",
           k->pid, k->device[0] ? k->device : "-", k->step,
           sp_state_name(SP_MACHINE_ROOT, k->root_state), coll_w, coll, heard,
           k->alerts, p50, p90, p99, score);
    if (k->victim) printf("      victim of rank %u\n", k->victim_of);
    if (k->last_alert[0] != '\0')
      printf("      last alert: %s\n", k->last_alert);
    if (unit_states && scratch != NULL && k->n_unit_states > 0)
      print_unit_states(k, scratch);
    i++;
  }
  free(scratch);
}

static int ranks_json(const Shardplane__V1__ListRanksResponse *l,
                      bool unit_states) {
  json_t *ranks = json_array();
  for (size_t i = 0; i < l->n_ranks; i++) {
    const Shardplane__V1__RankInfo *k = l->ranks[i];
    json_t *o = json_pack(
        "{s:i,s:s,s:s,s:i,s:s,s:I,s:s,s:o,s:I,s:i,s:s,s:I}", "rank",
        (int)k->rank, "status", rank_status_name(k->status), "host", k->host,
        "pid", (int)k->pid, "device", k->device, "step", (json_int_t)k->step,
        "root_state", sp_state_name(SP_MACHINE_ROOT, k->root_state),
        "last_collective", sp_remote_collective_json(k->last_collective),
        "last_heard_ms_ago", (json_int_t)k->last_heard_ms_ago, "alerts",
        (int)k->alerts, "last_alert", k->last_alert, "transitions",
        (json_int_t)k->transitions);
    if (o != NULL) {
      json_object_set_new(o, "step_p50_ms", json_real(k->step_p50_ms));
      json_object_set_new(o, "step_p90_ms", json_real(k->step_p90_ms));
      json_object_set_new(o, "step_p99_ms", json_real(k->step_p99_ms));
      json_object_set_new(o, "straggler_score", json_real(k->straggler_score));
      json_object_set_new(o, "victim", json_boolean(k->victim));
      json_object_set_new(o, "victim_of",
                          k->victim ? json_integer(k->victim_of) : json_null());
    }
    if (o != NULL && unit_states) {
      json_t *us = json_array();
      for (size_t u = 0; u < k->n_unit_states; u++)
        json_array_append_new(us, json_string(sp_state_name(
                                      SP_MACHINE_HANDLE, k->unit_states[u])));
      json_object_set_new(o, "unit_states", us);
    }
    json_array_append_new(ranks, o);
  }
  return sp_render_json_out(json_pack("{s:o}", "ranks", ranks)) == 0
             ? SP_EXIT_OK
             : SP_EXIT_FAILURE;
}

int sp_cmd_ranks(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "ranks");
  bool unit_states = false;
  const struct option own[] = {
      {"unit-states", no_argument, NULL, OPT_UNIT_STATES}};
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_ranks, argc, argv, own, 1, ranks_opt,
                                &unit_states, &first, &n);
  if (ec != PROCEED) return ec;
  /* Page by page: 100,000 attached ranks with 100 units' states are about
   * 16 MB in one answer, over the 8 MiB a coordinator sends. A
   * coordinator that does not page answers every rank at once, which ends
   * the loop too. */
  Shardplane__V1__ListRanksResponse **pages = NULL;
  size_t n_pages = 0, total = 0;
  uint32_t next = 0;
  for (;;) {
    Shardplane__V1__ListRanksRequest q =
        SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
    q.with_unit_states = unit_states;
    q.first_rank = next;
    q.max_ranks = RANKS_PAGE;
    ProtobufCMessage *m;
    ec = sp_remote_call(&r, SP_COORD_PATH("ListRanks"), &q.base,
                        &shardplane__v1__list_ranks_response__descriptor, &m);
    if (ec != SP_EXIT_OK) break;
    Shardplane__V1__ListRanksResponse *l =
        (Shardplane__V1__ListRanksResponse *)m;
    if (l->n_ranks > 0 && l->ranks[0]->rank != next) {
      /* not the page asked for: a coordinator that does not page said
       * it all in the first answer */
      sp_remote_free_msg(m);
      break;
    }
    void *grown = realloc(pages, (n_pages + 1) * sizeof *pages);
    if (grown == NULL) {
      sp_remote_free_msg(m);
      fprintf(stderr, "shardplane ranks: out of memory\n");
      ec = SP_EXIT_FAILURE;
      break;
    }
    pages = grown;
    pages[n_pages++] = l;
    total += l->n_ranks;
    if (l->n_ranks != RANKS_PAGE) break; /* the last page, or all at once */
    next += RANKS_PAGE;
  }
  Shardplane__V1__RankInfo **all =
      ec == SP_EXIT_OK ? calloc(total + 1, sizeof *all) : NULL;
  if (ec == SP_EXIT_OK && all == NULL) {
    fprintf(stderr, "shardplane ranks: out of memory\n");
    ec = SP_EXIT_FAILURE;
  }
  if (ec == SP_EXIT_OK) {
    size_t k = 0;
    for (size_t p = 0; p < n_pages; p++)
      for (size_t i = 0; i < pages[p]->n_ranks; i++)
        all[k++] = pages[p]->ranks[i];
    Shardplane__V1__ListRanksResponse l =
        SHARDPLANE__V1__LIST_RANKS_RESPONSE__INIT;
    l.n_ranks = total;
    l.ranks = all;
    if (r.json)
      ec = ranks_json(&l, unit_states);
    else
      print_ranks(&l, unit_states);
  }
  free(all);
  for (size_t p = 0; p < n_pages; p++) sp_remote_free_msg(pages[p]);
  free(pages);
  return sp_remote_finish(&r, ec);
}
