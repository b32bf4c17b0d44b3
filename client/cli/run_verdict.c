/* What `shardplane run` asks its coordinator (run_verdict.h): the verdict
 * on a failure, and where the ranks are while the job trains. A worker that
 * stops because a peer stalled exits 1 like the one at fault; only the
 * coordinator, which saw every rank, can say which one it was, and where
 * each rank is. */
#include "run_verdict.h"

#include <stdio.h>
#include <string.h>

#include "plan/state.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "rpc/rpc_cred.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* One call with the admin token: the answer in *out (the caller frees
 * it), or NULL when the coordinator could not be asked or said no. */
static void ask(const char *addr, const char *token_file, unsigned timeout_ms,
                const char *path, const ProtobufCMessage *q,
                const ProtobufCMessageDescriptor *reply,
                ProtobufCMessage **out) {
  *out = NULL;
  sp_cred cred = {.insecure = true, .token_file = token_file};
  sp_diag d = {{0}};
  if (sp_cred_finish(&cred, &d) != 0) return;
  sp_rpc_client_opts co = {.connect_timeout_ms = timeout_ms};
  sp_cred_client_opts(&cred, &co);
  sp_rpc_sync *rpc = NULL;
  if (sp_rpc_sync_open_opts(addr, &co, &rpc) != 0) return;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  if (sp_rpc_sync_unary(rpc, path, q, reply, timeout_ms, &m, &st) == 0 &&
      st.code == SP_RPC_OK)
    *out = m;
  else if (m != NULL)
    protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_close(rpc);
}

bool sp_run_verdict(const char *addr, const char *token_file,
                    unsigned timeout_ms, char *buf, size_t len) {
  if (len > 0) buf[0] = '\0';
  Shardplane__V1__GetVerdictRequest q =
      SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
  ProtobufCMessage *m;
  ask(addr, token_file, timeout_ms, SP_COORD_PATH("GetVerdict"), &q.base,
      &shardplane__v1__verdict__descriptor, &m);
  if (m == NULL) return false;
  const Shardplane__V1__Verdict *v = (const Shardplane__V1__Verdict *)m;
  bool bad = !v->healthy && v->headline[0] != '\0';
  if (bad) snprintf(buf, len, "%s", v->headline);
  protobuf_c_message_free_unpacked(m, NULL);
  return bad;
}

/* Where a rank is: the state of the innermost unit at work (units are
 * numbered root first, so the highest index not IDLE), else its root's. */
static const char *place_of(const Shardplane__V1__RankInfo *k) {
  for (size_t u = k->n_unit_states; u-- > 0;)
    if (k->unit_states[u] > SP_HANDLE_IDLE)
      return sp_state_name(SP_MACHINE_HANDLE, k->unit_states[u]);
  return sp_state_name(SP_MACHINE_ROOT, k->root_state);
}

bool sp_run_ranks_line(const char *addr, const char *token_file,
                       unsigned timeout_ms, char *buf, size_t len) {
  if (len > 0) buf[0] = '\0';
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  q.with_unit_states = true;
  ProtobufCMessage *m;
  ask(addr, token_file, timeout_ms, SP_COORD_PATH("ListRanks"), &q.base,
      &shardplane__v1__list_ranks_response__descriptor, &m);
  if (m == NULL) return false;
  const Shardplane__V1__ListRanksResponse *l =
      (const Shardplane__V1__ListRanksResponse *)m;
  /* the places in the order first seen, and how many ranks are there */
  const char *places[16];
  unsigned count[16], n_places = 0, attached = 0, lost = 0, detached = 0,
                      other = 0;
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < l->n_ranks; i++) {
    const Shardplane__V1__RankInfo *k = l->ranks[i];
    if (k->status == SHARDPLANE__V1__RANK_STATUS__LOST) lost++;
    if (k->status == SHARDPLANE__V1__RANK_STATUS__DETACHED) detached++;
    if (k->status != SHARDPLANE__V1__RANK_STATUS__ATTACHED) continue;
    attached++;
    if (k->step < lo) lo = k->step;
    if (k->step > hi) hi = k->step;
    const char *p = place_of(k);
    unsigned j = 0;
    while (j < n_places && strcmp(places[j], p) != 0) j++;
    if (j == n_places && n_places < 16) {
      places[n_places] = p;
      count[n_places++] = 0;
    }
    if (j < n_places)
      count[j]++;
    else
      other++;
  }
  size_t w = 0;
#define PUT(...)                                                    \
  do {                                                              \
    int n_ = snprintf(buf + w, w < len ? len - w : 0, __VA_ARGS__); \
    if (n_ > 0) w += (size_t)n_;                                    \
  } while (0)
  if (attached == 0) {
    PUT("none of %zu attached", l->n_ranks);
    if (detached > 0) PUT(", %u detached", detached);
  } else {
    if (lo == hi)
      PUT("step %llu:", (unsigned long long)lo);
    else
      PUT("steps %llu-%llu:", (unsigned long long)lo, (unsigned long long)hi);
    for (unsigned j = 0; j < n_places; j++)
      if (count[j] == attached && attached > 1)
        PUT(" all %u in %s", attached, places[j]);
      else
        PUT("%s %u in %s", j ? "," : "", count[j], places[j]);
    if (other > 0) PUT(", %u elsewhere", other);
  }
  if (lost > 0) PUT(", %u lost", lost);
  if (attached > 0 && attached + lost + detached < l->n_ranks)
    PUT(", %zu not attached", l->n_ranks - attached - lost - detached);
  if (attached > 0 && detached > 0) PUT(", %u detached", detached);
#undef PUT
  protobuf_c_message_free_unpacked(m, NULL);
  return true;
}
