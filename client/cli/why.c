/* `shardplane why`: the coordinator's verdict on the job (GetVerdict), in
 * the words an operator of a stuck job needs first: who, where and why. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "shardplane/v1/coordinator.pb-c.h"

static const subcmd k_why = {
    "why [options]",
    "The coordinator's verdict on the job: \"healthy: ...\" with its\n"
    "progress, or what is wrong in plain words (which rank stalls, which\n"
    "collective the others wait in, who desynchronised), then each open\n"
    "alert with its culprits and victims.\n"
    "\nexit code 5: the job has an open alert or failed (0: healthy or\n"
    "still starting).\n\n",
    0, 0, "an open alert, or the job failed"};

static bool has_trouble(const Shardplane__V1__Verdict *v) {
  return v->n_open_alerts > 0 ||
         v->state == SHARDPLANE__V1__JOB_STATE__JOB_FAILED;
}

/* The headline; a coordinator that leaves it empty gets one made here from
 * the state and progress. */
static void headline(const Shardplane__V1__Verdict *v, char *buf, size_t len) {
  if (v->headline[0] != '\0') {
    snprintf(buf, len, "%s", v->headline);
    return;
  }
  char p[256];
  sp_remote_progress_words(v->progress, p, sizeof p);
  snprintf(buf, len, "%s: job %s, %s", v->healthy ? "healthy" : "unhealthy",
           sp_remote_job_state_name(v->state), p);
}

static void print_verdict(const Shardplane__V1__Verdict *v) {
  char h[1024];
  headline(v, h, sizeof h);
  printf("%s\n", h);
  /* the text is the longer account; one that only repeats the headline
   * (the alert lines below say the rest) adds nothing */
  const char *t = v->text;
  const char *nl = strchr(t, '\n');
  bool one_line = nl == NULL || nl[1] == '\0';
  if (t[0] != '\0' && !(one_line && strstr(t, h) != NULL))
    printf("%s%s", t, t[strlen(t) - 1] == '\n' ? "" : "\n");
  sp_remote_print_quorum(stdout, "replica groups: ", 0, v->quorum);
  for (size_t i = 0; i < v->n_open_alerts; i++) {
    fputs("  open alert ", stdout);
    sp_remote_print_alert(stdout, v->open_alerts[i]);
    putchar('\n');
  }
}

static int verdict_json(const Shardplane__V1__Verdict *v) {
  char h[1024];
  headline(v, h, sizeof h);
  json_t *alerts = json_array();
  for (size_t i = 0; i < v->n_open_alerts; i++)
    json_array_append_new(alerts, sp_remote_alert_json(v->open_alerts[i]));
  json_t *root = json_pack(
      "{s:b,s:s,s:s,s:s,s:o,s:o}", "healthy", v->healthy, "state",
      sp_remote_job_state_name(v->state), "headline", h, "text", v->text,
      "progress", sp_remote_progress_json(v->progress), "open_alerts", alerts);
  if (root)
    json_object_set_new(root, "quorum", sp_remote_quorum_json(v->quorum));
  return sp_render_json_out(root) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}

int sp_cmd_why(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "why");
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_why, argc, argv, NULL, 0, NULL, NULL,
                                &first, &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__GetVerdictRequest q =
      SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
  ProtobufCMessage *m;
  ec = sp_remote_call(&r, SP_COORD_PATH("GetVerdict"), &q.base,
                      &shardplane__v1__verdict__descriptor, &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__Verdict *v = (const Shardplane__V1__Verdict *)m;
    if (r.json)
      ec = verdict_json(v);
    else
      print_verdict(v);
    if (ec == SP_EXIT_OK && has_trouble(v)) ec = SP_EXIT_ALERT;
    sp_remote_free_msg(m);
  }
  return sp_remote_finish(&r, ec);
}
