/* The coordinator's durability (--state-dir): when its state goes to the
 * database (coord_db.c) and how a coordinator started on an existing state
 * dir picks the job up again.
 *
 * Group commit: a write (store set/add/compare-and-set/delete, a rank's
 * registration, an alert) opens a transaction if none is open; its answer
 * is packed and kept, not sent. A prepare handle, which runs once per loop
 * iteration after every callback of the iteration before, commits and only
 * then sends the answers kept. A client therefore never hears of a write
 * that a kill -9 could lose, and one loop iteration's writes cost one
 * commit however many there were.
 *
 * Request ids: StoreAdd and StoreCompareSet may carry one (the worker's
 * session id and a sequence number). Their packed answer is recorded under
 * it in the same transaction as the write, so a retry after a lost answer
 * (the coordinator died between commit and send, or the connection broke)
 * is answered from the record instead of applied twice.
 *
 * Without a state dir every function here is a pass-through: answers go
 * out at once and nothing is recorded.
 */
#include "coord_persist.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_alerts.h" /* how many alerts are read back */
#include "coord_base.h"
#include "coord_db.h"

/* Rank snapshots (step, states) are written on this period, not per
 * transition: ingest must not pay a database row per event. */
#define SNAPSHOT_MS 1000u

typedef struct pending {
  sp_rpc_call *call; /* NULL once the call went away */
  size_t len;
  uint8_t *data;
} pending;

struct sp_coord_persist {
  sp_coord_db *db;
  uv_prepare_t commit;
  uv_timer_t snapshot;
  pending *q;
  size_t n, cap;
  uv_close_cb closed;
  sp_coord_persist_hooks hooks;
  bool started;             /* the handles exist (from listen on) */
  uint64_t commits, writes; /* for the log at shutdown */
};

static sp_coord_db *db_of(const sp_coord *c) {
  return c->persist != NULL ? c->persist->db : NULL;
}

bool sp_coord_persist_durable(const sp_coord *c) { return db_of(c) != NULL; }

/* Sends (or fails) every kept answer, in the order they were made. */
static void flush_answers(sp_coord_persist *p, int code, const char *msg) {
  for (size_t i = 0; i < p->n; i++) {
    pending *a = &p->q[i];
    if (a->call != NULL) {
      if (code == SP_RPC_OK) {
        int rc = sp_rpc_call_send_raw(a->call, a->data, a->len);
        if (rc == 0)
          sp_rpc_call_finish(a->call, SP_RPC_OK, NULL);
        else
          sp_rpc_call_finishf(a->call, SP_RPC_INTERNAL,
                              "cannot send the answer: %s", sp_strerror(rc));
      } else {
        sp_rpc_call_finish(a->call, code, msg);
      }
    }
    free(a->data);
  }
  p->n = 0;
}

static void commit_now(sp_coord *c) {
  sp_coord_persist *p = c->persist;
  if (p == NULL) return;
  int code = SP_RPC_OK;
  char msg[SP_DIAG_MAX] = "";
  if (sp_coord_db_in_txn(p->db)) {
    sp_diag d = {""};
    if (sp_coord_db_commit(p->db, &d) != 0) {
      sp_coord_db_rollback(p->db);
      code = SP_RPC_UNAVAILABLE;
      snprintf(msg, sizeof msg, "%s", d.msg);
      sp_coord_base_log(c, "%s", d.msg);
    } else {
      p->commits++;
    }
  }
  flush_answers(p, code, msg);
}

static void on_commit(uv_prepare_t *h) { commit_now(h->data); }

static void on_snapshot(uv_timer_t *t) {
  sp_coord *c = t->data;
  c->persist->hooks.snapshot(c);
}

int sp_coord_persist_reply(sp_coord *c, sp_rpc_call *call,
                           const ProtobufCMessage *m) {
  sp_coord_persist *p = c->persist;
  if (p == NULL || !sp_coord_db_in_txn(p->db))
    return sp_rpc_call_reply(call, m);
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 64;
    pending *q = realloc(p->q, cap * sizeof *q);
    if (q == NULL) {
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return SP_ENOMEM;
    }
    p->q = q;
    p->cap = cap;
  }
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *data = malloc(len ? len : 1);
  if (data == NULL) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return SP_ENOMEM;
  }
  protobuf_c_message_pack(m, data);
  p->q[p->n++] = (pending){call, len, data};
  /* no commit handle (before listen, or shutting down): commit now */
  if (!p->started || p->closed != NULL) commit_now(c);
  return 0;
}

void sp_coord_persist_forget(sp_coord *c, sp_rpc_call *call) {
  sp_coord_persist *p = c->persist;
  if (p == NULL) return;
  for (size_t i = 0; i < p->n; i++)
    if (p->q[i].call == call) p->q[i].call = NULL;
}

/* A write that could not be written down: the caller answers INTERNAL. */
static int write_failed(sp_coord *c, int rc) {
  sp_coord_base_log(c, "%s", sp_coord_db_error(c->persist->db));
  return rc;
}

int sp_coord_persist_key(sp_coord *c, const char *key, size_t klen) {
  sp_coord_db *db = db_of(c);
  if (db == NULL) return 0;
  c->persist->writes++;
  const uint8_t *v;
  size_t n;
  uint64_t ver;
  int rc = sp_kvstore_get(c->store, key, klen, &v, &n, &ver) == 0
               ? sp_coord_db_put_key(db, key, klen, v, n, ver)
               : sp_coord_db_del_key(db, key, klen);
  return rc != 0 ? write_failed(c, rc) : 0;
}

int sp_coord_persist_replay(sp_coord *c, sp_rpc_call *call, const char *id) {
  sp_coord_db *db = db_of(c);
  if (db == NULL || id == NULL || id[0] == '\0') return 0;
  uint8_t *resp;
  size_t len;
  int rc = sp_coord_db_get_request(db, id, SP_COORD_MAX_MESSAGE, &resp, &len);
  if (rc <= 0) {
    if (rc < 0) {
      sp_rpc_call_finishf(call, SP_RPC_INTERNAL, "state dir: %s",
                          sp_coord_db_error(db));
      return 1;
    }
    return 0;
  }
  sp_coord_base_log(c, "request %.80s answered again from the state dir", id);
  /* it may have been written in this very iteration: answer after commit */
  sp_coord_persist *p = c->persist;
  if (sp_coord_db_in_txn(db)) {
    if (p->n == p->cap) {
      size_t cap = p->cap ? 2 * p->cap : 64;
      pending *q = realloc(p->q, cap * sizeof *q);
      if (q == NULL) {
        free(resp);
        sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return 1;
      }
      p->q = q;
      p->cap = cap;
    }
    p->q[p->n++] = (pending){call, len, resp};
    return 1;
  }
  if (sp_rpc_call_send_raw(call, resp, len) == 0)
    sp_rpc_call_finish(call, SP_RPC_OK, NULL);
  else
    sp_rpc_call_finish(call, SP_RPC_INTERNAL, "cannot send the answer");
  free(resp);
  return 1;
}

int sp_coord_persist_answer(sp_coord *c, sp_rpc_call *call, const char *id,
                            const ProtobufCMessage *m) {
  sp_coord_db *db = db_of(c);
  if (db != NULL && id != NULL && id[0] != '\0') {
    size_t len = protobuf_c_message_get_packed_size(m);
    uint8_t *data = malloc(len ? len : 1);
    if (data == NULL) {
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return SP_ENOMEM;
    }
    protobuf_c_message_pack(m, data);
    int rc = sp_coord_db_put_request(db, id, data, len);
    free(data);
    if (rc != 0) {
      write_failed(c, rc);
      sp_rpc_call_finishf(call, SP_RPC_INTERNAL, "state dir: %s",
                          sp_coord_db_error(db));
      return rc;
    }
  }
  return sp_coord_persist_reply(c, call, m);
}

int sp_coord_persist_rank(sp_coord *c, const sp_coord_db_rank *r) {
  sp_coord_db *db = db_of(c);
  if (db == NULL) return 0;
  int rc = sp_coord_db_put_rank(db, r);
  return rc != 0 ? write_failed(c, rc) : 0;
}

void sp_coord_persist_alert(sp_coord *c, uint32_t rank, int kind,
                            const char *msg, uint64_t time_ms) {
  sp_coord_db *db = db_of(c);
  if (db == NULL) return;
  if (sp_coord_db_add_alert(db, rank, kind, msg, time_ms) != 0)
    write_failed(c, 0);
}

void sp_coord_persist_incarnation(sp_coord *c,
                                  const sp_coord_db_incarnation *r) {
  sp_coord_db *db = db_of(c);
  if (db == NULL) return;
  c->persist->writes++;
  if (sp_coord_db_put_incarnation(db, r) != 0) write_failed(c, 0);
}

/* ---- restore ---- */

static int restore_key(void *arg, const uint8_t *k, size_t kl, const uint8_t *v,
                       size_t vl, uint64_t ver) {
  sp_coord *c = arg;
  /* the database is input like any other: a key must be one the RPCs
   * could have made (no NUL: keys are proto3 strings) */
  if (kl > SP_COORD_MAX_KEY || vl > SP_COORD_MAX_VALUE || ver == 0 ||
      memchr(k, 0, kl) != NULL)
    return SP_EFORMAT;
  return sp_kvstore_restore(c->store, k, kl, v, vl, ver);
}

static int restore_rank(void *arg, const sp_coord_db_rank *r) {
  sp_coord *c = arg;
  return c->persist->hooks.rank(c, r);
}

static int restore_alert(void *arg, uint32_t rank, int kind, const char *msg,
                         size_t len, uint64_t time_ms) {
  sp_coord *c = arg;
  return c->persist->hooks.alert(c, rank, kind, msg, len, time_ms);
}

static int restore_incarnation(void *arg, const sp_coord_db_incarnation *r) {
  sp_coord *c = arg;
  return c->persist->hooks.incarnation(c, r);
}

static int last_world(void *arg, const sp_coord_db_incarnation *r) {
  *(uint32_t *)arg = r->world_size;
  return 0;
}

/* Fills *n_alerts with the count of every alert logged. */
static int restore(sp_coord *c, uint64_t *n_alerts, sp_diag *d) {
  sp_coord_db *db = c->persist->db;
  int rc = sp_coord_db_each_key(db, restore_key, c, d);
  if (rc == SP_EFORMAT || rc == SP_ETOOBIG)
    return sp_diag_set(d, rc, "state dir %s: a store row out of bounds",
                       sp_coord_db_dir(db));
  if (rc != 0) return rc;
  /* the last incarnation's world (elastic nodes) sizes the rank table
   * the ranks are read into */
  uint32_t world = 0;
  if ((rc = sp_coord_db_each_incarnation(db, last_world, &world, d)) != 0)
    return rc;
  if (world > c->full_world)
    return sp_diag_set(d, SP_EFORMAT,
                       "state dir %s: an incarnation of %u ranks; the job "
                       "has %u at most",
                       sp_coord_db_dir(db), world, c->full_world);
  if (world != 0 && (rc = sp_coord_set_world(c, world, d)) != 0) return rc;
  if ((rc = sp_coord_db_each_rank(db, restore_rank, c, d)) != 0) {
    if (rc != SP_EIO)
      sp_diag_set(d, rc, "state dir %s: a rank row out of bounds",
                  sp_coord_db_dir(db));
    return rc;
  }
  rc = sp_coord_db_each_alert(db, SP_COORD_ALERTS_RECENT, restore_alert, c,
                              n_alerts, d);
  c->persist->hooks.alerts_counted(c, *n_alerts);
  if (rc == SP_EFORMAT)
    sp_diag_set(d, rc, "state dir %s: an alert row out of bounds",
                sp_coord_db_dir(db));
  if (rc != 0) return rc;
  rc = sp_coord_db_each_incarnation(db, restore_incarnation, c, d);
  if (rc == SP_EFORMAT)
    sp_diag_set(d, rc,
                "state dir %s: an incarnation row out of order or "
                "bounds",
                sp_coord_db_dir(db));
  return rc;
}

int sp_coord_persist_open(sp_coord *c, const sp_coord_persist_hooks *h,
                          sp_diag *d) {
  if (c->cfg.state_dir == NULL) return 0;
  sp_coord_persist *p = calloc(1, sizeof *p);
  if (p == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  sp_coord_db_job job = {
      .plan_version = c->full_version,
      .model_name = c->model->name,
      .spec_hash = sp_coord_db_hash(c->spec_json, c->spec_len),
      .world_size = c->full_world};
  bool fresh;
  int rc = sp_coord_db_open(c->cfg.state_dir, &job, &p->db, &fresh, d);
  if (rc != 0) {
    free(p);
    return rc;
  }
  p->hooks = *h;
  c->persist = p;
  if (!fresh) {
    uint64_t n_alerts = 0;
    if ((rc = restore(c, &n_alerts, d)) != 0) return rc;
    sp_kvstore_stats st;
    sp_kvstore_get_stats(c->store, &st);
    sp_coord_base_log(c,
                      "continuing the job from state dir %s: %zu store keys, "
                      "%" PRIu64 " alerts",
                      c->cfg.state_dir, st.keys, n_alerts);
  } else {
    sp_coord_base_log(c, "new state dir %s", c->cfg.state_dir);
  }
  return 0;
}

void sp_coord_persist_start(sp_coord *c) {
  sp_coord_persist *p = c->persist;
  if (p == NULL || p->started) return;
  p->started = true;
  uv_prepare_init(c->loop, &p->commit);
  p->commit.data = c;
  uv_prepare_start(&p->commit, on_commit);
  uv_timer_init(c->loop, &p->snapshot);
  p->snapshot.data = c;
  uv_update_time(c->loop);
  uv_timer_start(&p->snapshot, on_snapshot, SNAPSHOT_MS, SNAPSHOT_MS);
}

static void snapshot_closed(uv_handle_t *h) {
  sp_coord *c = h->data;
  if (c->persist->closed) c->persist->closed(h);
}

static void commit_closed(uv_handle_t *h) {
  sp_coord *c = h->data;
  uv_close((uv_handle_t *)&c->persist->snapshot, snapshot_closed);
}

bool sp_coord_persist_shutdown(sp_coord *c, uv_close_cb closed) {
  sp_coord_persist *p = c->persist;
  if (p == NULL) return false;
  /* the last snapshot and every answer still kept go out now */
  p->hooks.snapshot(c);
  commit_now(c);
  sp_coord_base_log(
      c, "state dir %s: %" PRIu64 " store writes in %" PRIu64 " commits",
      sp_coord_db_dir(p->db), p->writes, p->commits);
  if (!p->started) return false;
  p->closed = closed;
  uv_prepare_stop(&p->commit);
  uv_timer_stop(&p->snapshot);
  uv_close((uv_handle_t *)&p->commit, commit_closed);
  return true;
}

void sp_coord_persist_free(sp_coord *c) {
  sp_coord_persist *p = c->persist;
  if (p == NULL) return;
  if (sp_coord_db_in_txn(p->db) && sp_coord_db_commit(p->db, NULL) != 0)
    sp_coord_base_log(c, "%s", sp_coord_db_error(p->db));
  /* answers never sent: their calls went with the server */
  for (size_t i = 0; i < p->n; i++) free(p->q[i].data);
  free(p->q);
  sp_coord_db_close(p->db);
  free(p);
  c->persist = NULL;
}
