/* The hub: load, plan, wire the areas together, serve, shut down. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "coord_agents.h"
#include "coord_api.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_bus.h"
#include "coord_dashboard.h"
#include "coord_desync.h"
#include "coord_diag.h"
#include "coord_dump.h"
#include "coord_events.h"
#include "coord_http.h"
#include "coord_metrics.h"
#include "coord_history.h"
#include "coord_persist.h"
#include "coord_plan.h"
#include "coord_quorum.h"
#include "coord_ranks.h"
#include "coord_stall.h"
#include "coord_store.h"
#include "coord_straggler.h"
#include "coord_verdict.h"
#include "coordinator.h"

/* The job file first, then the flags on top of it. */
static int load_job(const sp_coord_config *cfg, sp_job *job, sp_diag *diag) {
  sp_job_init(job);
  if (cfg->job_path != NULL) {
    int rc = sp_job_load_file(cfg->job_path, job, diag);
    if (rc != 0) return rc;
  }
  const sp_job *f = &cfg->job;
  sp_job defaults;
  sp_job_init(&defaults);
  if (f->world_size != defaults.world_size) job->world_size = f->world_size;
  if (f->strategy != defaults.strategy) job->strategy = f->strategy;
  if (f->shard_group_size) job->shard_group_size = f->shard_group_size;
  if (f->backend != defaults.backend) job->backend = f->backend;
  if (f->use_orig_params) job->use_orig_params = true;
  if (f->mp.enabled) {
    job->mp.enabled = true;
    if (f->mp.param_dtype) job->mp.param_dtype = f->mp.param_dtype;
    if (f->mp.reduce_dtype) job->mp.reduce_dtype = f->mp.reduce_dtype;
    if (f->mp.buffer_dtype) job->mp.buffer_dtype = f->mp.buffer_dtype;
    if (f->mp.keep_low_precision_grads) job->mp.keep_low_precision_grads = true;
  }
  const struct {
    const sp_strlist *from;
    sp_strlist *to;
  } lists[] = {{&f->wrap_types, &job->wrap_types},
               {&f->wrap_modules, &job->wrap_modules},
               {&f->mp.full_precision_types, &job->mp.full_precision_types}};
  for (size_t i = 0; i < 3; i++)
    for (size_t k = 0; k < lists[i].from->n; k++) {
      int rc = sp_strlist_add(lists[i].to, lists[i].from->items[k]);
      if (rc != 0) return sp_diag_set(diag, rc, "job: too many names");
    }
  if (f->mp.full_precision_types_set) job->mp.full_precision_types_set = true;
  return 0;
}

/* Who hears what the areas announce, in the order they act on it: the
 * record the detectors read before the detectors, the dump of a
 * message's flight record before the step it closed is judged (a
 * straggler alert the step raises is not in a dump the record
 * completes), the detectors on the tick in the order they were written
 * in (ties, progress, stall, stragglers), then what reads the progress:
 * the metrics and the dashboard's sample of what they concluded. */
static int wire(sp_coord *c) {
  static const struct {
    sp_coord_event_kind kind;
    sp_coord_event_fn fn;
  } subs[] = {
      {SP_COORD_EV_ATTACHING, sp_coord_verdict_refuse_attach},
      {SP_COORD_EV_ATTACHED, sp_coord_diag_attached},
      {SP_COORD_EV_ATTACHED, sp_coord_straggler_attached},
      {SP_COORD_EV_ATTACHED, sp_coord_verdict_attached},
      {SP_COORD_EV_DETACHED, sp_coord_verdict_detached},
      {SP_COORD_EV_LOST, sp_coord_verdict_lost},
      {SP_COORD_EV_TRANSITION, sp_coord_diag_transition},
      {SP_COORD_EV_SESSION_UP, sp_coord_verdict_session_up},
      {SP_COORD_EV_COLLECTIVE, sp_coord_diag_collective},
      {SP_COORD_EV_COLLECTIVE, sp_coord_desync_collective},
      {SP_COORD_EV_SESSION_UP_DONE, sp_coord_dump_flight},
      {SP_COORD_EV_SESSION_UP_DONE, sp_coord_diag_session_up_done},
      {SP_COORD_EV_ABORTED, sp_coord_verdict_aborted},
      {SP_COORD_EV_ABORTED, sp_coord_dump_write},
      {SP_COORD_EV_RANK_INFO, sp_coord_diag_rank_info},
      {SP_COORD_EV_RANK_INFO, sp_coord_straggler_rank_info},
      {SP_COORD_EV_RANK_INFO, sp_coord_verdict_rank_info},
      {SP_COORD_EV_INCARNATION, sp_coord_ranks_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_diag_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_desync_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_stall_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_straggler_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_verdict_new_incarnation},
      {SP_COORD_EV_INCARNATION, sp_coord_alerts_new_incarnation},
      {SP_COORD_EV_ALERT_LOGGED, sp_coord_ranks_alert_logged},
      {SP_COORD_EV_WORKERS_ALIVE, sp_coord_ranks_workers_alive},
      {SP_COORD_EV_WORKER_EXITED, sp_coord_ranks_worker_exited},
      {SP_COORD_EV_ALERT, sp_coord_agents_alert},
      {SP_COORD_EV_ALERT, sp_coord_metrics_alert},
      {SP_COORD_EV_TICK, sp_coord_desync_tick},
      {SP_COORD_EV_TICK, sp_coord_verdict_tick},
      {SP_COORD_EV_TICK, sp_coord_stall_tick},
      {SP_COORD_EV_TICK, sp_coord_straggler_tick},
      {SP_COORD_EV_TICK, sp_coord_metrics_tick},
      {SP_COORD_EV_TICK, sp_coord_history_tick},
      {SP_COORD_EV_TICK, sp_coord_agents_tick},
      {SP_COORD_EV_STEP, sp_coord_straggler_step},
      {SP_COORD_EV_STEP, sp_coord_metrics_step},
      {SP_COORD_EV_FAULT, sp_coord_dump_write},
      {SP_COORD_EV_COMPLETED, sp_coord_agents_completed},
  };
  for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
    int rc = sp_coord_bus_subscribe(c, subs[i].kind, subs[i].fn, NULL);
    if (rc != 0) return rc;
  }
  return 0;
}

int sp_coord_new(uv_loop_t *loop, const sp_coord_config *cfg, sp_coord **out,
                 sp_diag *diag) {
  if (loop == NULL || cfg == NULL || cfg->model_path == NULL || out == NULL)
    return sp_diag_set(diag, SP_EINVAL, "coordinator: a model spec is needed");
  sp_coord *c = calloc(1, sizeof *c);
  if (c == NULL) return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  c->loop = loop;
  c->cfg = *cfg;
  if (!c->cfg.heartbeat_timeout_ms) c->cfg.heartbeat_timeout_ms = 5000;
  /* The default interval leaves room for two missed beats before the
   * timeout, also when only the timeout was shortened (tests). */
  if (!c->cfg.heartbeat_interval_ms) {
    uint32_t third = c->cfg.heartbeat_timeout_ms / 3;
    c->cfg.heartbeat_interval_ms = third == 0 ? 1 : third < 1000 ? third : 1000;
  }
  uv_update_time(loop); /* the loop may not have run for a while */
  c->started_ms = uv_now(loop);
  /* One long-lived connection per rank, with few calls on each: memory
   * per connection counts more than header bytes per call. The start of
   * a job is a burst of calls (every rank's Attach and rendezvous) whose
   * memory is freed under the Session streams that follow: the sweep
   * gives it back (SP_COORD_TRIM_BYTES). */
  sp_rpc_server_opts opts = {.max_message = SP_COORD_MAX_MESSAGE,
                             .max_pending = 2 * SP_COORD_MAX_MESSAGE,
                             .no_header_tables = true,
                             .trim_heap_bytes = SP_COORD_TRIM_BYTES,
                             /* read by sp_coord_auth_authorize, no handler */
                             .metadata_to_authorize = true,
                             .max_connections = cfg->max_connections,
                             .preface_timeout_ms = cfg->preface_timeout_ms,
                             .idle_timeout_ms = cfg->idle_timeout_ms,
                             .request_timeout_ms = cfg->request_timeout_ms,
                             .max_buffered = cfg->max_buffered};
  int rc;
  /* Read once, keep the bytes, parse those same bytes: a file rewritten
   * meanwhile cannot make GetModelSpec disagree with the plan. */
  if ((rc = sp_json_read_file(cfg->model_path, SP_MODEL_MAX_FILE_BYTES,
                              &c->spec_json, &c->spec_len, diag)) != 0 ||
      (rc = sp_model_load_string(c->spec_json, c->spec_len, cfg->model_path,
                                 &c->model, diag)) != 0 ||
      (rc = load_job(cfg, &c->job, diag)) != 0 ||
      (rc = sp_plan_build(c->model, &c->job, &c->plan, diag)) != 0)
    goto fail;
  c->full_world = c->plan->world_size;
  memcpy(c->full_version, c->plan->version_hex, sizeof c->full_version);
  if (cfg->token_file != NULL) {
    rc = sp_coord_auth_load(cfg->token_file, &cfg->store_quota, &c->auth, diag);
    if (rc != 0) goto fail;
    opts.authorize = sp_coord_auth_authorize;
    opts.authorize_arg = c->auth;
  }
  opts.tls = cfg->tls;
  if ((rc = sp_rpc_server_new(loop, &opts, &c->srv)) != 0 ||
      (rc = sp_kvstore_new(NULL, &c->store)) != 0) {
    sp_diag_set(diag, rc, "coordinator: %s", sp_strerror(rc));
    goto fail;
  }
  if ((rc = wire(c)) != 0 || (rc = sp_coord_alerts_init(c)) != 0 ||
      (rc = sp_coord_metrics_init(c)) != 0 ||
      (rc = sp_coord_ranks_init(c)) != 0 || (rc = sp_coord_diag_init(c)) != 0 ||
      (rc = sp_coord_desync_init(c)) != 0 ||
      (rc = sp_coord_stall_init(c)) != 0 ||
      (rc = sp_coord_straggler_init(c)) != 0 ||
      (rc = sp_coord_verdict_init(c)) != 0 ||
      (rc = sp_coord_history_init(c)) != 0 ||
      (rc = sp_coord_plan_register(c)) != 0 ||
      (rc = sp_coord_ranks_register(c)) != 0 ||
      (rc = sp_coord_events_register(c)) != 0 ||
      (rc = sp_coord_store_register(c)) != 0 ||
      (rc = sp_coord_verdict_register(c)) != 0 ||
      (rc = sp_coord_dump_register(c)) != 0 ||
      (rc = sp_coord_agents_register(c)) != 0) {
    sp_diag_set(diag, rc, "coordinator: cannot register the service: %s",
                sp_strerror(rc));
    goto fail;
  }
  /* last: the restored ranks need the rank table */
  static const sp_coord_persist_hooks hooks = {
      .rank = sp_coord_ranks_restore,
      .alert = sp_coord_alerts_restore,
      .alerts_counted = sp_coord_alerts_restored,
      .incarnation = sp_coord_agents_restore,
      .snapshot = sp_coord_ranks_snapshot};
  if ((rc = sp_coord_persist_open(c, &hooks, diag)) != 0) goto fail;
  /* after the store was read back: it holds the quorum of before */
  if ((rc = sp_coord_quorum_init(c)) != 0) {
    sp_diag_set(diag, rc, "coordinator: replica quorum: %s", sp_strerror(rc));
    goto fail;
  }
  sp_rpc_server_set_health(c->srv, SP_COORD_SERVICE, SP_HEALTH_SERVING);
  *out = c;
  return 0;
fail:
  sp_coord_free(c);
  return rc;
}

int sp_coord_set_world(sp_coord *c, uint32_t world, sp_diag *diag) {
  if (world == c->plan->world_size) return 0;
  uint32_t was = c->job.world_size;
  c->job.world_size = world;
  sp_plan *pl;
  int rc = sp_plan_build(c->model, &c->job, &pl, diag);
  if (rc == 0 && (rc = sp_coord_ranks_resize(c, pl)) != 0) sp_plan_free(pl);
  if (rc != 0) {
    c->job.world_size = was;
    if (rc == SP_ENOMEM) sp_diag_set(diag, rc, "out of memory");
    return rc;
  }
  /* the desync tables are freed by the topology they were made for */
  sp_coord_desync_free(c);
  sp_coord_quorum_free(c);
  sp_plan_free(c->plan);
  c->plan = pl;
  if ((rc = sp_coord_diag_new_incarnation(c, NULL, NULL)) != 0 ||
      (rc = sp_coord_desync_init(c)) != 0 ||
      (rc = sp_coord_straggler_new_incarnation(c, NULL, NULL)) != 0 ||
      (rc = sp_coord_verdict_new_incarnation(c, NULL, NULL)) != 0 ||
      (rc = sp_coord_quorum_init(c)) != 0)
    return sp_diag_set(diag, rc, "out of memory");
  return 0;
}

/* What the HTTP listener serves, beside its own /healthz, /login and
 * /logout; the first match wins. */
static const sp_coord_http_route k_http_routes[] = {
    {"/metrics", false, SP_COORD_HTTP_HEADER, sp_coord_metrics_route},
    {"/api/", true, SP_COORD_HTTP_READER, sp_coord_api_get},
    /* the page asks for a login itself; its script and style hold no
     * data */
    {"/", false, SP_COORD_HTTP_PAGE, sp_coord_dashboard_route},
    {"/index.html", false, SP_COORD_HTTP_PAGE, sp_coord_dashboard_route},
    {"/app.js", false, SP_COORD_HTTP_OPEN, sp_coord_dashboard_route},
    {"/style.css", false, SP_COORD_HTTP_OPEN, sp_coord_dashboard_route},
    {NULL, false, 0, NULL}};

int sp_coord_listen(sp_coord *c, const char *addr, int *port, sp_diag *diag) {
  int bound;
  int rc = sp_rpc_server_listen(c->srv, addr, &bound, diag);
  if (rc != 0) return rc;
  if (c->cfg.http_listen != NULL &&
      (rc = sp_coord_http_start(
           c, c->cfg.http_listen, k_http_routes,
           sizeof k_http_routes / sizeof k_http_routes[0] - 1, &c->http_port,
           diag)) != 0)
    return rc;
  if (port != NULL) *port = bound;
  if (!c->heartbeat_started) sp_coord_ranks_start(c);
  sp_coord_diag_start(c);
  sp_coord_persist_start(c);
  char host[256];
  int ignored;
  if (sp_rpc_split_addr(addr, host, sizeof host, &ignored) != 0)
    snprintf(host, sizeof host, "?");
  sp_coord_base_log(c, "serving %s (plan %s, %u ranks, %zu units) on %s%s%s:%d",
                    c->model->name, c->plan->version_hex, c->plan->world_size,
                    c->plan->n_units, strchr(host, ':') ? "[" : "", host,
                    strchr(host, ':') ? "]" : "", bound);
  return 0;
}

/* Shutdown has asynchronous steps (the server, the heartbeat and
 * diagnosis timers, and those an area adds: c->stopping counts them); the
 * caller hears about it when all are done. */
static void stop_step_done(sp_coord *c) {
  if (--c->stopping > 0) return;
  if (c->stop_done) c->stop_done(c, c->stop_arg);
}

static void server_stopped(sp_rpc_server *srv, void *arg) {
  (void)srv;
  stop_step_done(arg);
}

/* A handle whose data is the coordinator was released. */
static void handle_closed(uv_handle_t *h) { stop_step_done(h->data); }

static void diag_closed(void *c) { stop_step_done(c); }

void sp_coord_shutdown(sp_coord *c, void (*done)(sp_coord *, void *),
                       void *arg) {
  if (c->shutting_down) return;
  c->shutting_down = true;
  c->stop_done = done;
  c->stop_arg = arg;
  c->stopping = 3;
  sp_coord_base_log(c, "shutting down");
  c->heartbeat_timer.data = c;
  sp_coord_store_shutdown(c);
  if (sp_coord_agents_shutdown(c, handle_closed)) c->stopping++;
  sp_coord_events_shutdown(c);
  sp_coord_dump_shutdown(c);
  c->stopping++;
  sp_coord_http_shutdown(c, diag_closed);
  sp_coord_diag_shutdown(c, diag_closed);
  sp_coord_ranks_shutdown(c, handle_closed);
  /* after the ranks' last words, before the server goes */
  if (sp_coord_persist_shutdown(c, handle_closed)) c->stopping++;
  sp_rpc_server_shutdown(c->srv, 2000, server_stopped, c);
}

void sp_coord_free(sp_coord *c) {
  if (c == NULL) return;
  sp_coord_http_free(c);
  sp_rpc_server_free(c->srv);
  sp_coord_persist_free(c);
  sp_coord_history_free(c);
  sp_coord_verdict_free(c);
  sp_coord_straggler_free(c);
  sp_coord_stall_free(c);
  sp_coord_desync_free(c); /* before the membership it was made for */
  sp_coord_diag_free(c);
  sp_coord_ranks_free(c);
  sp_coord_agents_free(c);
  sp_coord_quorum_free(c);
  for (size_t i = 0; i < c->n_method_tables; i++) free(c->methods[i]);
  sp_coord_alerts_free(c);
  sp_coord_metrics_free(c);
  sp_kvstore_free(c->store);
  sp_coord_auth_free(c->auth);
  free(c->abort_reason);
  sp_plan_free(c->plan);
  sp_model_free(c->model);
  free(c->spec_json);
  sp_job_clear(&c->job);
  free(c);
}
