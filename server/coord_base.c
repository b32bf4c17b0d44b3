/* What every area of the coordinator uses: its clock, its log line, the
 * registration of its methods and the size check of request strings. */
#include "coord_base.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool sp_coord_base_text_ok(sp_rpc_call *call, const char *msg_name,
                           const char *field, const char *v, size_t max) {
  /* bounded: the engine refused messages over its limit */
  size_t n = v != NULL ? strlen(v) : 0;
  if (n <= max) return true;
  sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                      "shardplane.v1.%s.%s: %zu bytes, at most %zu", msg_name,
                      field, n, max);
  return false;
}

uint64_t sp_coord_base_now_ms(const sp_coord *c) {
  /* current, not as old as the loop iteration (only the loop's thread
   * calls this) */
  uv_update_time(c->loop);
  return uv_now(c->loop) - c->started_ms;
}

void sp_coord_base_log(const sp_coord *c, const char *fmt, ...) {
  if (c->cfg.quiet) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* one write, so that no other process's output lands inside the line */
  fprintf(stderr, "coordinator: %s\n", msg);
}

int sp_coord_base_add_methods(sp_coord *c, const sp_rpc_method *tmpl,
                              size_t n) {
  if (c->n_method_tables >= sizeof c->methods / sizeof c->methods[0])
    return SP_ETOOBIG;
  sp_rpc_method *m = malloc(n * sizeof *m);
  if (m == NULL) return SP_ENOMEM;
  memcpy(m, tmpl, n * sizeof *m);
  for (size_t i = 0; i < n; i++) m[i].user = c;
  c->methods[c->n_method_tables++] = m;
  return sp_rpc_server_add_methods(c->srv, m, n);
}
