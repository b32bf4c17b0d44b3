/* Durability (coord_persist.c, --state-dir): when the coordinator's state
 * goes to the state dir's database (coord_db.c) and how a coordinator
 * started on an existing one picks the job up again. The areas write
 * through here; what is read back, and the periodic snapshot of the
 * ranks, go to the areas that own them through hooks the hub hands over
 * at open, so that nothing here calls them. Without a state dir every
 * call is a pass-through: answers go out at once, nothing is written.
 *
 * Threads: the loop thread only. The module owns the database handle and
 * the answers it keeps until their transaction is committed. */
#ifndef SP_COORD_PERSIST_H
#define SP_COORD_PERSIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_db.h"
#include "coordinator.h"

/* What a state dir holds besides the store, handed back to its owners at
 * open (each returns 0 or SP_EFORMAT for a row out of bounds), and the
 * ranks' snapshot, written every second and at shutdown. */
typedef struct sp_coord_persist_hooks {
  int (*rank)(sp_coord *c, const sp_coord_db_rank *r);
  /* the newest alerts of the log, oldest first, then the count of all */
  int (*alert)(sp_coord *c, uint32_t rank, int kind, const char *msg,
               size_t len, uint64_t time_ms);
  void (*alerts_counted)(sp_coord *c, uint64_t total);
  int (*incarnation)(sp_coord *c, const sp_coord_db_incarnation *r);
  void (*snapshot)(sp_coord *c);
} sp_coord_persist_hooks;

/* Opens the state dir and restores the store, then hands back the ranks,
 * the alerts and the incarnations (from sp_coord_new, once every area is
 * set up); errors name the dir and what is wrong with it. */
int sp_coord_persist_open(sp_coord *c, const sp_coord_persist_hooks *h,
                          sp_diag *d);
/* The per-iteration commit and the rank snapshots (from sp_coord_listen). */
void sp_coord_persist_start(sp_coord *c);
/* Commits, answers what waits for it; returns true if `closed` will run
 * (once, when the handles are released). */
bool sp_coord_persist_shutdown(sp_coord *c, uv_close_cb closed);
void sp_coord_persist_free(sp_coord *c);

/* Whether there is a state dir. */
bool sp_coord_persist_durable(const sp_coord *c);
/* Answers a call once this iteration's writes are committed (at once
 * without a state dir, or when nothing was written). Like
 * sp_rpc_call_reply, the call is the engine's afterwards. */
int sp_coord_persist_reply(sp_coord *c, sp_rpc_call *call,
                           const ProtobufCMessage *m);
/* The call went away (on_cancel): its kept answer is dropped. */
void sp_coord_persist_forget(sp_coord *c, sp_rpc_call *call);
/* Writes the key's current value (or its absence) down. */
int sp_coord_persist_key(sp_coord *c, const char *key, size_t klen);
/* 1 when the request id is known and the call was answered (or failed)
 * from the record; 0 when the call is new. */
int sp_coord_persist_replay(sp_coord *c, sp_rpc_call *call, const char *id);
/* Records m under the request id (when given) and answers with it. */
int sp_coord_persist_answer(sp_coord *c, sp_rpc_call *call, const char *id,
                            const ProtobufCMessage *m);
int sp_coord_persist_rank(sp_coord *c, const sp_coord_db_rank *r);
void sp_coord_persist_alert(sp_coord *c, uint32_t rank, int kind,
                            const char *msg, uint64_t time_ms);
void sp_coord_persist_incarnation(sp_coord *c,
                                  const sp_coord_db_incarnation *r);

#endif
