/* What every area of the coordinator uses: its clock, its log line, the
 * registration of its methods and the size check of request strings.
 *
 * Threads: the coordinator's loop thread only, like everything in
 * server/. */
#ifndef SP_COORD_BASE_H
#define SP_COORD_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator.h"

/* Milliseconds since start. */
uint64_t sp_coord_base_now_ms(const sp_coord *c);
/* One log line (unless quiet): "coordinator: ...". */
void sp_coord_base_log(const sp_coord *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Whether a request's string field is at most max bytes; if not, finishes
 * the call with INVALID_ARGUMENT naming the field ("AttachRequest.host:
 * 4194304 bytes, at most 255") and returns false. NULL is an empty
 * string. */
bool sp_coord_base_text_ok(sp_rpc_call *call, const char *msg_name,
                           const char *field, const char *v, size_t max);

/* Copies a method template, points each entry's user at c, registers it.
 * SP_ETOOBIG past the hub's table of tables, SP_ENOMEM. */
int sp_coord_base_add_methods(sp_coord *c, const sp_rpc_method *tmpl, size_t n);

#endif
