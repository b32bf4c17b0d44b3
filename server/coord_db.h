/* The coordinator's state directory: one SQLite database (WAL mode) that
 * holds what a restarted coordinator needs to continue the job: the store
 * (keys, values, versions), the rank registrations with their session ids
 * and last snapshot, the job's identity (plan version, model name, spec
 * hash, world size), the alert log and the answers of non-idempotent store
 * calls by request id.
 *
 * Nothing here knows about RPCs or the loop: coord_persist.c decides when
 * to write (group commit per loop iteration) and what to restore.
 *
 * Threads: one thread only (the coordinator's loop); the connection is
 * opened without SQLite's mutexes.
 *
 * Errors: every function returns 0 (or 1 where said) or a negative SP_E*
 * code; SQLite failures are SP_EIO with "state dir DIR: what: SQLite's
 * message (file:line)" in diag and in sp_coord_db_error(). Everything read
 * back is untrusted: the caller checks sizes before using it.
 */
#ifndef SP_COORD_DB_H
#define SP_COORD_DB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

typedef struct sp_coord_db sp_coord_db;

/* What makes a state dir belong to one job. Strings are borrowed. */
typedef struct sp_coord_db_job {
  const char *plan_version;
  const char *model_name;
  uint64_t spec_hash; /* of the model spec's bytes */
  uint32_t world_size;
} sp_coord_db_job;

/* Opens (creating DIR and the database when absent) and locks DIR for this
 * process. *fresh says whether the database was new. Errors: SP_EEXIST when
 * another coordinator holds DIR (naming DIR and its pid), SP_EMISMATCH when
 * DIR belongs to another job (naming what differs), SP_EIO. */
int sp_coord_db_open(const char *dir, const sp_coord_db_job *job,
                     sp_coord_db **out, bool *fresh, sp_diag *d);
/* Rolls back an open transaction, closes, releases the lock. NULL: no-op. */
void sp_coord_db_close(sp_coord_db *db);
const char *sp_coord_db_dir(const sp_coord_db *db);
/* The last failure's message ("" when none). */
const char *sp_coord_db_error(const sp_coord_db *db);

/* Group commit: writes open a transaction when none is; commit ends it.
 * in_txn says whether one is open. */
bool sp_coord_db_in_txn(const sp_coord_db *db);
int sp_coord_db_commit(sp_coord_db *db, sp_diag *d);
/* Drops what the open transaction wrote (after a failed commit). */
void sp_coord_db_rollback(sp_coord_db *db);

int sp_coord_db_put_key(sp_coord_db *db, const void *key, size_t klen,
                        const void *value, size_t vlen, uint64_t version);
int sp_coord_db_del_key(sp_coord_db *db, const void *key, size_t klen);
/* Calls fn for every key; a non-zero return of fn stops and is returned. */
int sp_coord_db_each_key(sp_coord_db *db,
                         int (*fn)(void *arg, const uint8_t *k, size_t kl,
                                   const uint8_t *v, size_t vl, uint64_t ver),
                         void *arg, sp_diag *d);

/* The packed answer of a non-idempotent call, under its request id; kept
 * for the most recent SP_COORD_DB_REQUESTS_KEPT ids. */
#define SP_COORD_DB_REQUESTS_KEPT 100000
int sp_coord_db_put_request(sp_coord_db *db, const char *id,
                            const uint8_t *resp, size_t len);
/* 1 with *resp (malloc'd, caller frees) and *len when id is known, 0 when
 * not. SP_ETOOBIG when the stored answer is over max_len. */
int sp_coord_db_get_request(sp_coord_db *db, const char *id, size_t max_len,
                            uint8_t **resp, size_t *len);

/* One rank's registration and last snapshot. Strings and units borrowed. */
typedef struct sp_coord_db_rank {
  uint32_t rank;
  int32_t status; /* Shardplane__V1__RankStatus */
  const char *session_id, *host, *device;
  uint32_t pid;
  uint64_t step;
  int32_t root;
  const uint8_t *units; /* one state per unit */
  size_t n_units;
  uint32_t alerts;
  uint64_t transitions;
} sp_coord_db_rank;
int sp_coord_db_put_rank(sp_coord_db *db, const sp_coord_db_rank *r);
int sp_coord_db_each_rank(sp_coord_db *db,
                          int (*fn)(void *arg, const sp_coord_db_rank *r),
                          void *arg, sp_diag *d);

/* kind: Shardplane__V1__AlertKind (0 in a log written before kinds). */
int sp_coord_db_add_alert(sp_coord_db *db, uint32_t rank, int kind,
                          const char *msg, uint64_t time_ms);
/* The newest `last` alerts, oldest first, and the count of all. */
int sp_coord_db_each_alert(sp_coord_db *db, size_t last,
                           int (*fn)(void *arg, uint32_t rank, int kind,
                                     const char *msg, size_t len,
                                     uint64_t time_ms),
                           void *arg, uint64_t *total, sp_diag *d);

/* One incarnation of the job (coord_agents.c): its start and what ended
 * it. The reason is borrowed. */
typedef struct sp_coord_db_incarnation {
  uint64_t number, started_ms, ended_ms;
  bool ended, has_rank;
  bool completed; /* ended by the job's completion, not a death */
  uint32_t rank, max_restarts;
  uint32_t world_size; /* its world; 0: the job's configured one */
  int32_t exit_code, signal;
  const char *reason;
} sp_coord_db_incarnation;
/* Writes (or rewrites) the record of r->number. */
int sp_coord_db_put_incarnation(sp_coord_db *db,
                                const sp_coord_db_incarnation *r);
/* Every record, by number. */
int sp_coord_db_each_incarnation(sp_coord_db *db,
                                 int (*fn)(void *arg,
                                           const sp_coord_db_incarnation *r),
                                 void *arg, sp_diag *d);

/* FNV-1a, 64 bits: the spec hash a state dir is checked against. */
uint64_t sp_coord_db_hash(const void *p, size_t n);

#endif
