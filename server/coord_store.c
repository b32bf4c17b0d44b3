/* Store service: StoreSet, StoreGet, StoreAdd, StoreCompareSet,
 * StoreDelete, StoreWait, over server/kvstore.c.
 *
 * Status codes (validation in Redis's order: a malformed request first,
 * then the limits, then the store's own answer):
 *   empty key, or expected given with expect_absent    INVALID_ARGUMENT
 *   key over SP_COORD_MAX_KEY, value (desired,
 *   expected) over SP_COORD_MAX_VALUE, more than
 *   SP_COORD_STORE_MAX_WAIT_KEYS keys in one wait,
 *   store full (keys, bytes, waiters), out of memory    RESOURCE_EXHAUSTED
 *   StoreAdd on a value that is not a decimal integer   FAILED_PRECONDITION
 *     (the request is fine; the key's state is not)
 *   StoreAdd whose result (or current value) does not
 *   fit in int64                                       OUT_OF_RANGE
 *     (gRPC's code for "may succeed if the state changes")
 *   waiting call still open at shutdown                 UNAVAILABLE
 * StoreGet of an absent key without wait is OK with found=false; a failed
 * compare-and-set is OK with swapped=false.
 *
 * Waiting calls (StoreGet with wait, StoreWait) register a store waiter and
 * are answered from its callback, in the pass of the set that completes
 * them: no timers, no polling. The client's deadline is the engine's: it
 * cancels the call with DEADLINE_EXCEEDED and on_cancel cancels the waiter.
 * Without a deadline a call waits until its keys exist, the client cancels
 * or the coordinator shuts down.
 *
 * Keys are proto3 strings, which protobuf-c hands over NUL-terminated: a
 * key ends at its first NUL byte.
 *
 * With a state dir (coord_persist.c) every write is written down and its
 * answer, like that of a waiting call it released, goes out only once the
 * loop iteration's transaction committed; StoreAdd and StoreCompareSet
 * with a request id already seen are answered from the record.
 */
#include "coord_store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_base.h"
#include "coord_persist.h"
#include "coord_quorum.h"

/* TCPStore's cap on keys per multi-key command. */
#define SP_COORD_STORE_MAX_WAIT_KEYS (128u << 10)
/* How much of a key goes into an error message. */
#define KEY_SHOWN 64

/* One waiting call. Both directions are needed: on_cancel finds the waiter
 * through the call (its user pointer), the wake callback finds the call
 * through the waiter (its arg). */
typedef struct sp_coord_store_wait store_wait;
struct sp_coord_store_wait {
  sp_coord *c;
  sp_rpc_call *call;
  sp_kvstore_waiter *w; /* NULL while its callback runs */
  store_wait *prev, *next;
  size_t klen; /* StoreGet: the key to answer with; 0 for StoreWait */
  char key[];
};

/* The coordinator's waiting calls, so that shutdown can finish them. Only
 * the loop thread touches the list. */
static void waits_add(store_wait *r) {
  sp_coord *c = r->c;
  r->prev = NULL;
  r->next = c->store_waits;
  if (c->store_waits != NULL) c->store_waits->prev = r;
  c->store_waits = r;
}

static void waits_remove(store_wait *r) {
  if (r->prev != NULL)
    r->prev->next = r->next;
  else
    r->c->store_waits = r->next;
  if (r->next != NULL) r->next->prev = r->prev;
  r->prev = r->next = NULL;
}

/* Takes one of c's records off the list, or NULL when none is left. */
static store_wait *waits_take(sp_coord *c) {
  store_wait *r = c->store_waits;
  if (r != NULL) waits_remove(r);
  return r;
}

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

/* Maps a store error (sizes were checked before, so SP_ETOOBIG here means
 * the store as a whole is full). */
static void fail(sp_rpc_call *call, int rc, const char *key) {
  switch (rc) {
    case SP_EINVAL:
      sp_rpc_call_finish(call, SP_RPC_INVALID_ARGUMENT,
                         "invalid store request");
      break;
    case SP_ETOOBIG:
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED,
                         "store full (keys, bytes or waiters at the limit)");
      break;
    case SP_ENOMEM:
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      break;
    case SP_EFORMAT:
      sp_rpc_call_finishf(call, SP_RPC_FAILED_PRECONDITION,
                          "value of key '%.*s' is not a decimal integer",
                          KEY_SHOWN, key);
      break;
    case SP_ERANGE:
      sp_rpc_call_finishf(call, SP_RPC_OUT_OF_RANGE,
                          "value of key '%.*s' would overflow int64", KEY_SHOWN,
                          key);
      break;
    default:
      sp_rpc_call_finishf(call, SP_RPC_INTERNAL, "store: %s", sp_strerror(rc));
      break;
  }
}

/* The shape of a key: empty is malformed. */
static bool key_malformed(sp_rpc_call *call, const char *key,
                          const char *field) {
  if (key != NULL && key[0] != 0) return false;
  sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT, "%s is empty", field);
  return true;
}

/* The size of a key, after every malformed-request check. */
static bool key_oversize(sp_rpc_call *call, const char *key, size_t *klen,
                         const char *field) {
  /* strlen is bounded: the engine refused messages over
   * SP_COORD_MAX_MESSAGE before decoding them. */
  *klen = strlen(key);
  if (*klen <= SP_COORD_MAX_KEY) return false;
  sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                      "%s of %zu bytes is over the %u-byte limit", field, *klen,
                      (unsigned)SP_COORD_MAX_KEY);
  return true;
}

static bool value_oversize(sp_rpc_call *call, size_t len, const char *field) {
  if (len <= SP_COORD_MAX_VALUE) return false;
  sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                      "%s of %zu bytes is over the %u-byte limit", field, len,
                      (unsigned)SP_COORD_MAX_VALUE);
  return true;
}

static bool refuse_if_stopping(sp_rpc_call *call) {
  if (!coord_of(call)->shutting_down) return false;
  sp_rpc_call_finish(call, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  return true;
}

/* The writer's role and store quota (coord_auth.h), before anything
 * changes: true when the call was refused. vlen: the value the write may
 * leave; SIZE_MAX for a delete, which no quota limits. */
static bool write_refused(sp_rpc_call *call, const char *key, size_t klen,
                          size_t vlen) {
  const sp_rpc_principal *p = sp_rpc_call_principal(call);
  if (p == NULL) return false;
  char msg[SP_RPC_STATUS_MESSAGE_MAX];
  int code = sp_coord_auth_store_may_write(p, key, msg, sizeof msg);
  if (code == SP_RPC_OK && vlen != SIZE_MAX)
    code = sp_coord_auth_quota_check(coord_of(call)->auth, p, key, klen, vlen,
                                     msg, sizeof msg);
  if (code == SP_RPC_OK) return false;
  sp_rpc_call_finish(call, code, msg);
  return true;
}

/* After a write: the key now counts against its writer's quota. Out of
 * memory here only leaves the key unaccounted; the write itself stands. */
static void wrote(sp_rpc_call *call, const char *key, size_t klen,
                  size_t vlen) {
  (void)sp_coord_auth_quota_wrote(coord_of(call)->auth,
                                  sp_rpc_call_principal(call), key, klen, vlen);
}

static ProtobufCBinaryData bytes_of(const uint8_t *p, size_t n) {
  /* pack only reads it; the field type is not const */
  return (ProtobufCBinaryData){n, (uint8_t *)(uintptr_t)p};
}

/* ---- StoreSet --------------------------------------------------------- */

static void on_set(sp_rpc_call *call, const ProtobufCMessage *msg,
                   const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreSetRequest *q = (const void *)msg;
  size_t klen;
  if (key_malformed(call, q->key, "key") ||
      key_oversize(call, q->key, &klen, "key") ||
      value_oversize(call, q->value.len, "value") ||
      write_refused(call, q->key, klen, q->value.len))
    return;
  Shardplane__V1__StoreSetResponse r = SHARDPLANE__V1__STORE_SET_RESPONSE__INIT;
  /* Waiting calls released by this set are answered inside it. */
  sp_coord *c = coord_of(call);
  int rc = sp_kvstore_set(c->store, q->key, klen, q->value.data, q->value.len,
                          &r.version);
  if (rc == 0) rc = sp_coord_persist_key(c, q->key, klen);
  if (rc != 0) {
    fail(call, rc, q->key);
    return;
  }
  wrote(call, q->key, klen, q->value.len);
  sp_coord_quorum_key(c, q->key, klen);
  sp_coord_persist_reply(c, call, &r.base);
}

/* ---- StoreGet --------------------------------------------------------- */

/* A value may come from a write of this iteration: answered after commit. */
static void answer_get(sp_coord *c, sp_rpc_call *call, const uint8_t *v,
                       size_t n, uint64_t version) {
  Shardplane__V1__StoreGetResponse r = SHARDPLANE__V1__STORE_GET_RESPONSE__INIT;
  r.found = true;
  r.value = bytes_of(v, n);
  r.version = version;
  sp_coord_persist_reply(c, call, &r.base);
}

static void get_ready(void *arg) {
  store_wait *r = arg;
  sp_kvstore *st = r->c->store;
  r->w = NULL; /* the store frees it when this returns */
  const uint8_t *v;
  size_t n;
  uint64_t ver;
  if (sp_kvstore_get(st, r->key, r->klen, &v, &n, &ver) != 0) {
    /* A callback earlier in the same pass deleted it again: a GET that
     * waits answers with a value, so wait for the next one. */
    const void *k = r->key;
    int rc = sp_kvstore_wait(st, &k, &r->klen, 1, get_ready, r, &r->w);
    if (rc == 0) return;
    waits_remove(r);
    sp_rpc_call_set_user(r->call, NULL);
    if (rc == 1)
      sp_rpc_call_finish(r->call, SP_RPC_INTERNAL, "store: key vanished");
    else
      fail(r->call, rc, r->key);
    free(r);
    return;
  }
  waits_remove(r);
  sp_rpc_call_set_user(r->call, NULL);
  answer_get(r->c, r->call, v, n, ver);
  free(r);
}

static void on_get(sp_rpc_call *call, const ProtobufCMessage *msg,
                   const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreGetRequest *q = (const void *)msg;
  sp_coord *c = coord_of(call);
  size_t klen;
  if (key_malformed(call, q->key, "key") ||
      key_oversize(call, q->key, &klen, "key"))
    return;
  const uint8_t *v;
  size_t n;
  uint64_t ver;
  int rc = sp_kvstore_get(c->store, q->key, klen, &v, &n, &ver);
  if (rc == 0) {
    answer_get(c, call, v, n, ver);
    return;
  }
  if (rc != SP_ENOENT) {
    fail(call, rc, q->key);
    return;
  }
  if (!q->wait) {
    Shardplane__V1__StoreGetResponse r =
        SHARDPLANE__V1__STORE_GET_RESPONSE__INIT;
    sp_coord_persist_reply(c, call, &r.base);
    return;
  }
  if (refuse_if_stopping(call)) return;
  store_wait *r = malloc(sizeof *r + klen + 1);
  if (r == NULL) {
    fail(call, SP_ENOMEM, q->key);
    return;
  }
  *r = (store_wait){.c = c, .call = call, .klen = klen};
  memcpy(r->key, q->key, klen + 1);
  const void *k = r->key;
  rc = sp_kvstore_wait(c->store, &k, &r->klen, 1, get_ready, r, &r->w);
  if (rc != 0) {
    /* 1 cannot happen (the key was just absent and nothing ran since) */
    if (rc == 1)
      sp_rpc_call_finish(call, SP_RPC_INTERNAL, "store: key appeared");
    else
      fail(call, rc, q->key);
    free(r);
    return;
  }
  sp_rpc_call_set_user(call, r);
  waits_add(r);
}

/* ---- StoreWait -------------------------------------------------------- */

static void wait_ready(void *arg) {
  store_wait *r = arg;
  r->w = NULL;
  waits_remove(r);
  sp_rpc_call_set_user(r->call, NULL);
  Shardplane__V1__StoreWaitResponse resp =
      SHARDPLANE__V1__STORE_WAIT_RESPONSE__INIT;
  sp_coord_persist_reply(r->c, r->call, &resp.base);
  free(r);
}

static void on_wait(sp_rpc_call *call, const ProtobufCMessage *msg,
                    const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreWaitRequest *q = (const void *)msg;
  sp_coord *c = coord_of(call);
  size_t n = q->n_keys;
  for (size_t i = 0; i < n; i++)
    if (q->keys[i] == NULL || q->keys[i][0] == 0) {
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT, "keys[%zu] is empty",
                          i);
      return;
    }
  if (n > SP_COORD_STORE_MAX_WAIT_KEYS) {
    sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                        "%zu keys in one wait; the limit is %u", n,
                        (unsigned)SP_COORD_STORE_MAX_WAIT_KEYS);
    return;
  }
  Shardplane__V1__StoreWaitResponse resp =
      SHARDPLANE__V1__STORE_WAIT_RESPONSE__INIT;
  if (n == 0) { /* every one of no keys exists */
    sp_coord_persist_reply(c, call, &resp.base);
    return;
  }
  size_t *klens = malloc(n * sizeof *klens);
  if (klens == NULL) {
    fail(call, SP_ENOMEM, "");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    char field[32];
    snprintf(field, sizeof field, "keys[%zu]", i);
    if (key_oversize(call, q->keys[i], &klens[i], field)) {
      free(klens);
      return;
    }
  }
  if (c->shutting_down) {
    /* No new waiter now: answer only if there is nothing to wait for. */
    for (size_t i = 0; i < n; i++)
      if (sp_kvstore_get(c->store, q->keys[i], klens[i], NULL, NULL, NULL) !=
          0) {
        free(klens);
        refuse_if_stopping(call);
        return;
      }
    free(klens);
    sp_coord_persist_reply(c, call, &resp.base);
    return;
  }
  store_wait *r = malloc(sizeof *r);
  if (r == NULL) {
    free(klens);
    fail(call, SP_ENOMEM, "");
    return;
  }
  *r = (store_wait){.c = c, .call = call};
  /* The store copies what it keeps, so the request's strings will do. */
  int rc = sp_kvstore_wait(c->store, (const void *const *)q->keys, klens, n,
                           wait_ready, r, &r->w);
  free(klens);
  if (rc == 1) { /* all there already */
    free(r);
    sp_coord_persist_reply(c, call, &resp.base);
    return;
  }
  if (rc != 0) {
    free(r);
    fail(call, rc, q->keys[0]);
    return;
  }
  sp_rpc_call_set_user(call, r);
  waits_add(r);
}

/* The client cancelled, its deadline passed, or its connection went: the
 * call is gone, so is its waiter. */
static void on_cancel(sp_rpc_call *call, int code) {
  (void)code;
  sp_coord_persist_forget(coord_of(call), call);
  store_wait *r = sp_rpc_call_user(call);
  if (r == NULL) return; /* not a waiting call */
  sp_rpc_call_set_user(call, NULL);
  /* r->w may be NULL if this runs from inside r's own callback (a reply
   * that fails synchronously); the store then frees it itself. */
  if (r->w != NULL) sp_kvstore_cancel_wait(r->c->store, r->w);
  waits_remove(r);
  free(r);
}

/* ---- StoreAdd --------------------------------------------------------- */

static void on_add(sp_rpc_call *call, const ProtobufCMessage *msg,
                   const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreAddRequest *q = (const void *)msg;
  size_t klen;
  /* 20: the longest int64 in decimal, sign included */
  if (key_malformed(call, q->key, "key") ||
      key_oversize(call, q->key, &klen, "key") ||
      write_refused(call, q->key, klen, 20))
    return;
  sp_coord *c = coord_of(call);
  if (sp_coord_persist_replay(c, call, q->request_id)) return;
  Shardplane__V1__StoreAddResponse r = SHARDPLANE__V1__STORE_ADD_RESPONSE__INIT;
  int rc =
      sp_kvstore_add(c->store, q->key, klen, q->delta, &r.value, &r.version);
  if (rc == 0) rc = sp_coord_persist_key(c, q->key, klen);
  if (rc != 0) {
    fail(call, rc, q->key);
    return;
  }
  char digits[24];
  wrote(call, q->key, klen,
        (size_t)snprintf(digits, sizeof digits, "%lld", (long long)r.value));
  sp_coord_persist_answer(c, call, q->request_id, &r.base);
}

/* ---- StoreCompareSet -------------------------------------------------- */

static void on_compare_set(sp_rpc_call *call, const ProtobufCMessage *msg,
                           const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreCompareSetRequest *q = (const void *)msg;
  size_t klen;
  if (key_malformed(call, q->key, "key")) return;
  if (q->expect_absent && q->expected.len > 0) {
    /* Two conditions at once is a client bug; refuse rather than guess. */
    sp_rpc_call_finish(call, SP_RPC_INVALID_ARGUMENT,
                       "expected must be empty with expect_absent");
    return;
  }
  if (key_oversize(call, q->key, &klen, "key") ||
      value_oversize(call, q->desired.len, "desired") ||
      value_oversize(call, q->expected.len, "expected") ||
      write_refused(call, q->key, klen, q->desired.len))
    return;
  sp_coord *c = coord_of(call);
  if (sp_coord_persist_replay(c, call, q->request_id)) return;
  Shardplane__V1__StoreCompareSetResponse r =
      SHARDPLANE__V1__STORE_COMPARE_SET_RESPONSE__INIT;
  const uint8_t *v = NULL;
  size_t n = 0;
  bool swapped, found; /* protobuf_c_boolean is an int */
  int rc = sp_kvstore_compare_set(c->store, q->key, klen, q->expected.data,
                                  q->expected.len, q->expect_absent,
                                  q->desired.data, q->desired.len, &swapped, &v,
                                  &n, &found, &r.version);
  if (rc != 0) {
    fail(call, rc, q->key);
    return;
  }
  if (swapped) wrote(call, q->key, klen, q->desired.len);
  r.swapped = swapped;
  r.found = found;
  r.value = bytes_of(v, n);
  /* packed before anything else can change the value v points at */
  if (swapped && (rc = sp_coord_persist_key(c, q->key, klen)) != 0) {
    fail(call, rc, q->key);
    return;
  }
  sp_coord_persist_answer(c, call, q->request_id, &r.base);
}

/* ---- StoreDelete ------------------------------------------------------ */

static void on_delete(sp_rpc_call *call, const ProtobufCMessage *msg,
                      const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const Shardplane__V1__StoreDeleteRequest *q = (const void *)msg;
  size_t klen;
  if (key_malformed(call, q->key, "key") ||
      key_oversize(call, q->key, &klen, "key") ||
      write_refused(call, q->key, klen, SIZE_MAX))
    return;
  Shardplane__V1__StoreDeleteResponse r =
      SHARDPLANE__V1__STORE_DELETE_RESPONSE__INIT;
  bool deleted;
  sp_coord *c = coord_of(call);
  int rc = sp_kvstore_delete(c->store, q->key, klen, &deleted);
  if (rc == 0 && deleted) rc = sp_coord_persist_key(c, q->key, klen);
  if (rc != 0) {
    fail(call, rc, q->key);
    return;
  }
  if (deleted) sp_coord_auth_quota_deleted(coord_of(call)->auth, q->key, klen);
  r.deleted = deleted;
  sp_coord_persist_reply(c, call, &r.base);
}

/* ---- registration ----------------------------------------------------- */

#define METHOD(name, desc, fn) \
  { SP_COORD_PATH(name), SP_RPC_UNARY, &desc, fn, NULL, on_cancel, NULL }

static const sp_rpc_method k_methods[] = {
    METHOD("StoreSet", shardplane__v1__store_set_request__descriptor, on_set),
    METHOD("StoreGet", shardplane__v1__store_get_request__descriptor, on_get),
    METHOD("StoreAdd", shardplane__v1__store_add_request__descriptor, on_add),
    METHOD("StoreCompareSet",
           shardplane__v1__store_compare_set_request__descriptor,
           on_compare_set),
    METHOD("StoreDelete", shardplane__v1__store_delete_request__descriptor,
           on_delete),
    METHOD("StoreWait", shardplane__v1__store_wait_request__descriptor,
           on_wait),
};

int sp_coord_store_register(sp_coord *c) {
  if (c == NULL || c->store == NULL) return SP_EINVAL;
  return sp_coord_base_add_methods(c, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}

/* Finishes every waiting call of c with UNAVAILABLE, one at a time: a
 * finish could in principle fail other calls synchronously, whose
 * on_cancel must still find their records on the list. */
void sp_coord_store_shutdown(sp_coord *c) {
  if (c == NULL) return;
  store_wait *r;
  while ((r = waits_take(c)) != NULL) {
    if (r->w != NULL) sp_kvstore_cancel_wait(c->store, r->w);
    sp_rpc_call_set_user(r->call, NULL);
    sp_rpc_call_finish(r->call, SP_RPC_UNAVAILABLE,
                       "coordinator shutting down");
    free(r);
  }
}
