/* `shardplane incarnations`: the job's incarnations as the coordinator
 * recorded them (ListIncarnations): when each began and ended, and what
 * ended it. An operator asks it after a restart to learn which rank died
 * and how, without the agents' logs of every host. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "shardplane/v1/coordinator.pb-c.h"

static const subcmd k_incarnations = {
    "incarnations [options]",
    "The job's incarnations (0 first, one more per restart, as agents and\n"
    "`shardplane run` make them): when each began and ended, in UTC, and\n"
    "what ended it (the rank, its exit code or signal, or the job's\n"
    "completion).\n"
    "The first line says which incarnation is current and how many of the\n"
    "job's --max-restarts are used. A job without restarts has only\n"
    "incarnation 0. With --state-dir the record survives the coordinator's\n"
    "restart.\n\n",
    0, 0, NULL};

/* "2026-12-01 21:03:04.123Z" */
static void format_utc(uint64_t unix_ms, char *buf, size_t cap) {
  time_t s = (time_t)(unix_ms / 1000);
  struct tm tm;
  if (gmtime_r(&s, &tm) == NULL ||
      strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm) == 0) {
    snprintf(buf, cap, "%" PRIu64 " ms", unix_ms);
    return;
  }
  size_t n = strlen(buf);
  snprintf(buf + n, cap - n, ".%03uZ", (unsigned)(unix_ms % 1000));
}

static void print_incarnations(
    const Shardplane__V1__ListIncarnationsResponse *l) {
  printf("incarnation %" PRIu64 " is current; %u of %u restart%s used\n",
         l->current, l->restarts, l->max_restarts,
         l->max_restarts == 1 ? "" : "s");
  printf("%-4s  %-24s  %-24s  %-5s  %s\n", "INC", "STARTED", "ENDED", "RANKS",
         "WHAT ENDED IT");
  for (size_t i = 0; i < l->n_incarnations; i++) {
    const Shardplane__V1__Incarnation *x = l->incarnations[i];
    char start[40], end[40];
    format_utc(x->started_unix_ms, start, sizeof start);
    if (x->ended)
      format_utc(x->ended_unix_ms, end, sizeof end);
    else
      snprintf(end, sizeof end, "-");
    const char *what = x->reason[0] != '\0' ? x->reason
                       : x->ended           ? "(not recorded)"
                                            : "running";
    char ranks[16] = "-"; /* the job's configured world (not elastic) */
    if (x->world_size) snprintf(ranks, sizeof ranks, "%u", x->world_size);
    printf("%-4" PRIu64 "  %-24s  %-24s  %-5s  %s\n", x->number, start, end,
           ranks, what);
  }
  sp_remote_print_quorum(stdout, "replica groups: ", 0, l->quorum);
}

static json_t *incarnation_json(const Shardplane__V1__Incarnation *x) {
  json_t *o = json_pack("{s:I,s:I,s:b}", "number", (json_int_t)x->number,
                        "started_unix_ms", (json_int_t)x->started_unix_ms,
                        "ended", x->ended);
  if (o == NULL) return NULL;
  if (x->ended)
    json_object_set_new(o, "ended_unix_ms",
                        json_integer((json_int_t)x->ended_unix_ms));
  if (x->has_rank) {
    json_object_set_new(o, "rank", json_integer(x->rank));
    json_object_set_new(o, "exit_code", json_integer(x->exit_code));
    json_object_set_new(o, "signal", json_integer(x->signal));
  }
  json_object_set_new(o, "completed", json_boolean(x->completed));
  if (x->world_size)
    json_object_set_new(o, "world_size", json_integer(x->world_size));
  json_object_set_new(o, "reason", json_string(x->reason));
  return o;
}

static int incarnations_json(
    const Shardplane__V1__ListIncarnationsResponse *l) {
  json_t *arr = json_array();
  for (size_t i = 0; i < l->n_incarnations; i++)
    json_array_append_new(arr, incarnation_json(l->incarnations[i]));
  json_t *root = json_pack("{s:I,s:i,s:i,s:o,s:o}", "current",
                           (json_int_t)l->current, "restarts", (int)l->restarts,
                           "max_restarts", (int)l->max_restarts, "incarnations",
                           arr, "quorum", sp_remote_quorum_json(l->quorum));
  return sp_render_json_out(root) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}

int sp_cmd_incarnations(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "incarnations");
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_incarnations, argc, argv, NULL, 0, NULL,
                                NULL, &first, &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__ListIncarnationsRequest q =
      SHARDPLANE__V1__LIST_INCARNATIONS_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  ec = sp_remote_call(&r, SP_COORD_PATH("ListIncarnations"), &q.base,
                      &shardplane__v1__list_incarnations_response__descriptor,
                      &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__ListIncarnationsResponse *l =
        (const Shardplane__V1__ListIncarnationsResponse *)m;
    if (r.json)
      ec = incarnations_json(l);
    else
      print_incarnations(l);
  }
  sp_remote_free_msg(m);
  return sp_remote_finish(&r, ec);
}
