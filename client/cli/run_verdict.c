/* The coordinator's verdict for `shardplane run` (run_verdict.h). A worker
 * that stops because a peer stalled exits 1 like the one at fault; only the
 * coordinator, which saw every rank, can say which one it was. */
#include "run_verdict.h"

#include <stdio.h>
#include <string.h>

#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "rpc/rpc_cred.h"
#include "shardplane/v1/coordinator.pb-c.h"

bool sp_run_verdict(const char *addr, const char *token_file,
                    unsigned timeout_ms, char *buf, size_t len) {
  if (len > 0) buf[0] = '\0';
  sp_cred cred = {.insecure = true, .token_file = token_file};
  sp_diag d = {{0}};
  if (sp_cred_finish(&cred, &d) != 0) return false;
  sp_rpc_client_opts co = {.connect_timeout_ms = timeout_ms};
  sp_cred_client_opts(&cred, &co);
  sp_rpc_sync *rpc = NULL;
  if (sp_rpc_sync_open_opts(addr, &co, &rpc) != 0) return false;
  Shardplane__V1__GetVerdictRequest q =
      SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  bool bad = false;
  if (sp_rpc_sync_unary(rpc, SP_COORD_PATH("GetVerdict"), &q.base,
                        &shardplane__v1__verdict__descriptor, timeout_ms, &m,
                        &st) == 0 &&
      st.code == SP_RPC_OK) {
    const Shardplane__V1__Verdict *v = (const Shardplane__V1__Verdict *)m;
    bad = !v->healthy && v->headline[0] != '\0';
    if (bad) snprintf(buf, len, "%s", v->headline);
  }
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_close(rpc);
  return bad;
}
