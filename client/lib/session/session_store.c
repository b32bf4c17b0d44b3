/* The session's blocking calls (session.c has the overview): a small pool
 * of connections, so a thread waiting on a store key never holds up
 * another thread's call, and the store functions on it. Any thread. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "session_internal.h"

/* ------------------------------------------------------------------ */
/* Blocking calls: a pool of connections                               */
/* ------------------------------------------------------------------ */

int sp_session_pool_init(sp_session *s, sp_diag *d) {
  if (uv_mutex_init(&s->pool_lock) != 0)
    return sp_diag_set(d, SP_EIO, "cannot create a lock");
  if (uv_cond_init(&s->pool_cond) != 0) {
    uv_mutex_destroy(&s->pool_lock);
    return sp_diag_set(d, SP_EIO, "cannot create a lock");
  }
  s->pool_ready = true;
  return 0;
}

void sp_session_pool_close(sp_session *s) {
  if (!s->pool_ready) return;
  /* a store call still running on another thread returns its connection
   * first (the caller must not start new ones now) */
  uv_mutex_lock(&s->pool_lock);
  while (s->n_free < s->n_open) uv_cond_wait(&s->pool_cond, &s->pool_lock);
  uv_mutex_unlock(&s->pool_lock);
  for (size_t i = 0; i < s->n_free; i++) sp_rpc_sync_close(s->pool_free[i]);
  uv_mutex_destroy(&s->pool_lock);
  uv_cond_destroy(&s->pool_cond);
  s->pool_ready = false;
}

static int pool_get(sp_session *s, sp_rpc_sync **out, sp_diag *d) {
  uv_mutex_lock(&s->pool_lock);
  while (s->n_free == 0 && s->n_open >= SP_SESSION_STORE_CONNS)
    uv_cond_wait(&s->pool_cond, &s->pool_lock);
  if (s->n_free > 0) {
    *out = s->pool_free[--s->n_free];
    uv_mutex_unlock(&s->pool_lock);
    return 0;
  }
  s->n_open++;
  uv_mutex_unlock(&s->pool_lock);
  /* connecting happens on the first call; this only allocates */
  sp_rpc_client_opts co = {.connect_timeout_ms = s->connect_timeout_ms};
  sp_session_cred_client_opts(&s->cred, &co);
  int rc = sp_rpc_sync_open_opts(s->coordinator, &co, out);
  if (rc != 0) {
    uv_mutex_lock(&s->pool_lock);
    s->n_open--;
    uv_cond_signal(&s->pool_cond);
    uv_mutex_unlock(&s->pool_lock);
    return sp_diag_set(d, rc, "cannot open a connection to %s: %s",
                       s->coordinator, sp_strerror(rc));
  }
  return 0;
}

static void pool_put(sp_session *s, sp_rpc_sync *c) {
  uv_mutex_lock(&s->pool_lock);
  s->pool_free[s->n_free++] = c;
  uv_cond_broadcast(&s->pool_cond);
  uv_mutex_unlock(&s->pool_lock);
}

/* Whether a call that ended with `code` is tried again: only once the
 * session is attached (open's calls fail fast), only when the coordinator
 * could not be reached (UNAVAILABLE: it died or restarts), and within the
 * grace period counted from the call's first failure. Sleeps the backoff. */
static bool retry_after(sp_session *s, int code, uint64_t first_fail_ns,
                        uint64_t *base, uint64_t *jitter) {
  if (code != SP_RPC_UNAVAILABLE || s->session_id == NULL || s->grace_ms == 0)
    return false;
  uint64_t spent_ms = (uv_hrtime() - first_fail_ns) / 1000000;
  if (spent_ms >= s->grace_ms) return false;
  uint64_t delay = sp_session_backoff(base, jitter);
  if (delay > s->grace_ms - spent_ms) delay = s->grace_ms - spent_ms;
  uv_sleep((unsigned)delay);
  return true;
}

int sp_session_unary(sp_session *s, const char *what, const char *path,
                     const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *desc,
                     uint64_t timeout_ms, ProtobufCMessage **resp,
                     sp_rpc_status *st_out, sp_diag *d) {
  if (st_out != NULL) {
    st_out->code = SP_RPC_UNKNOWN; /* no call made */
    st_out->message[0] = '\0';
  }
  sp_rpc_sync *c;
  int rc = pool_get(s, &c, d);
  if (rc != 0) return rc;
  sp_rpc_status st = {0};
  ProtobufCMessage *r = NULL;
  uint64_t first_fail = 0, base = 0, jitter = uv_hrtime();
  for (;;) {
    rc = sp_rpc_sync_unary(c, path, req, desc, timeout_ms, &r, &st);
    if (rc != 0 || st.code != SP_RPC_UNAVAILABLE) break;
    if (first_fail == 0) first_fail = uv_hrtime();
    if (!retry_after(s, st.code, first_fail, &base, &jitter)) {
      if (s->session_id != NULL && s->grace_ms != 0)
        snprintf(st.message, sizeof st.message,
                 "the coordinator at %s was unreachable for longer than the "
                 "grace period of %" PRIu64 " ms (--coordinator-grace)",
                 s->coordinator, s->grace_ms);
      break;
    }
  }
  pool_put(s, c);
  if (st_out != NULL) *st_out = st;
  if (rc != 0) return sp_diag_set(d, rc, "%s: %s", what, sp_strerror(rc));
  if (st.code != SP_RPC_OK)
    return sp_diag_set(d, sp_session_rpc_error(st.code), "%s: %s: %s", what,
                       sp_rpc_code_name(st.code),
                       st.message[0] ? st.message : "(no message)");
  if (desc != NULL && r == NULL)
    return sp_diag_set(d, SP_EFORMAT, "%s: the answer does not decode", what);
  if (resp != NULL)
    *resp = r;
  else if (r != NULL)
    protobuf_c_message_free_unpacked(r, NULL);
  return 0;
}
/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

static int check_key(const char *op, const char *key, sp_diag *d) {
  if (key == NULL || key[0] == '\0')
    return sp_diag_set(d, SP_EINVAL, "store %s: a key is required", op);
  size_t n = strlen(key);
  if (n > SP_SESSION_STORE_MAX_KEY)
    return sp_diag_set(d, SP_ETOOBIG,
                       "store %s: a %zu-byte key is over the limit of %u", op,
                       n, SP_SESSION_STORE_MAX_KEY);
  return 0;
}

int sp_session_store_set(sp_session *s, const char *key, const void *val,
                         size_t len, sp_diag *d) {
  if (s == NULL || (val == NULL && len > 0))
    return sp_diag_set(d, SP_EINVAL, "store set: bad arguments");
  int rc = check_key("set", key, d);
  if (rc != 0) return rc;
  if (len > SP_SESSION_STORE_MAX_VALUE)
    return sp_diag_set(d, SP_ETOOBIG,
                       "store set \"%.*s\": a %zu-byte value is over the "
                       "limit of %u",
                       KEY_SHOWN, key, len, SP_SESSION_STORE_MAX_VALUE);
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.value.data = (uint8_t *)val;
  q.value.len = len;
  char what[96];
  snprintf(what, sizeof what, "store set \"%.*s\"", KEY_SHOWN, key);
  return sp_session_unary(s, what, SP_COORD_PATH("StoreSet"), &q.base,
                          &shardplane__v1__store_set_response__descriptor,
                          s->call_timeout_ms, NULL, NULL, d);
}

int sp_session_store_get(sp_session *s, const char *key, uint64_t wait_ms,
                         uint8_t **val, size_t *len, sp_diag *d) {
  if (s == NULL || val == NULL || len == NULL)
    return sp_diag_set(d, SP_EINVAL, "store get: bad arguments");
  *val = NULL;
  *len = 0;
  int rc = check_key("get", key, d);
  if (rc != 0) return rc;
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  /* waiting is the coordinator's: the call's deadline ends it */
  q.wait = wait_ms > 0;
  char what[96];
  snprintf(what, sizeof what, "store get \"%.*s\"", KEY_SHOWN, key);
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  rc = sp_session_unary(s, what, SP_COORD_PATH("StoreGet"), &q.base,
                        &shardplane__v1__store_get_response__descriptor,
                        wait_ms > 0 ? wait_ms : s->call_timeout_ms, &m, &st, d);
  if (rc != 0) {
    if (st.code == SP_RPC_DEADLINE_EXCEEDED && wait_ms > 0)
      return sp_diag_set(d, SP_ETIMEDOUT, "%s: not set within %" PRIu64 " ms",
                         what, wait_ms);
    return rc;
  }
  Shardplane__V1__StoreGetResponse *r = (Shardplane__V1__StoreGetResponse *)m;
  if (!r->found) {
    rc = sp_diag_set(d, SP_ENOENT, "%s: no such key", what);
  } else {
    uint8_t *copy = malloc(r->value.len ? r->value.len : 1);
    if (copy == NULL) {
      rc = sp_diag_set(d, SP_ENOMEM, "out of memory");
    } else {
      if (r->value.len) memcpy(copy, r->value.data, r->value.len);
      *val = copy;
      *len = r->value.len;
    }
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return rc;
}

int sp_session_store_add(sp_session *s, const char *key, int64_t delta,
                         int64_t *value, sp_diag *d) {
  if (s == NULL) return sp_diag_set(d, SP_EINVAL, "store add: bad arguments");
  int rc = check_key("add", key, d);
  if (rc != 0) return rc;
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)key;
  q.delta = delta;
  /* the same id on every retry: the coordinator applies it once */
  char req_id[96];
  if (s->session_id != NULL) {
    snprintf(req_id, sizeof req_id, "%s:%" PRIu64, s->session_id,
             atomic_fetch_add(&s->req_seq, 1) + 1);
    q.request_id = req_id;
  }
  char what[96];
  snprintf(what, sizeof what, "store add \"%.*s\"", KEY_SHOWN, key);
  ProtobufCMessage *m = NULL;
  rc = sp_session_unary(s, what, SP_COORD_PATH("StoreAdd"), &q.base,
                        &shardplane__v1__store_add_response__descriptor,
                        s->call_timeout_ms, &m, NULL, d);
  if (rc != 0) return rc;
  if (value != NULL) *value = ((Shardplane__V1__StoreAddResponse *)m)->value;
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

static int comm_store_set(void *user, const char *key, const void *val,
                          size_t len, sp_diag *d) {
  return sp_session_store_set(user, key, val, len, d);
}

static int comm_store_get(void *user, const char *key, uint64_t wait_ms,
                          uint8_t **val, size_t *len, sp_diag *d) {
  return sp_session_store_get(user, key, wait_ms, val, len, d);
}

static int comm_store_add(void *user, const char *key, int64_t delta,
                          int64_t *value, sp_diag *d) {
  return sp_session_store_add(user, key, delta, value, d);
}

sp_comm_store sp_session_comm_store(sp_session *s) {
  sp_comm_store cs = {comm_store_set, comm_store_get, comm_store_add, s};
  return cs;
}
