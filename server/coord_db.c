/* The state directory's database (coord_db.h).
 *
 * Durability: journal_mode=WAL with synchronous=NORMAL. In WAL mode a
 * committed transaction is in the WAL file when COMMIT returns, so it
 * survives the coordinator's process dying in any way (kill -9 included);
 * only an OS crash or a power loss can roll back the last transactions
 * before a checkpoint. FULL would add an fsync per commit, i.e. per loop
 * iteration that wrote, for protection against failures that take the
 * workers' host down as well (they then restart from a checkpoint anyway).
 *
 * One coordinator per directory: an exclusive flock on DIR/coordinator.lock,
 * held while the database is open; the lock goes with the process however
 * it ends, so a SIGKILLed coordinator never leaves a stale lock.
 */
#include "coord_db.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define DB_FILE "coordinator.db"
#define LOCK_FILE "coordinator.lock"
/* Paths and stored strings this module accepts. */
#define DIR_MAX 3072
#define META_MAX 256
#define FORMAT "shardplane.state/v1"

enum {
  ST_PUT_KEY,
  ST_DEL_KEY,
  ST_PUT_REQ,
  ST_GET_REQ,
  ST_PRUNE_REQ,
  ST_PUT_RANK,
  ST_ADD_ALERT,
  ST_PUT_INCARNATION,
  ST_N
};

static const char *const k_sql[ST_N] = {
    [ST_PUT_KEY] =
        "INSERT OR REPLACE INTO store(key, value, version) "
        "VALUES (?1, ?2, ?3)",
    [ST_DEL_KEY] = "DELETE FROM store WHERE key = ?1",
    [ST_PUT_REQ] =
        "INSERT OR REPLACE INTO requests(id, response) "
        "VALUES (?1, ?2)",
    [ST_GET_REQ] = "SELECT response FROM requests WHERE id = ?1",
    [ST_PRUNE_REQ] = "DELETE FROM requests WHERE rowid <= ?1",
    [ST_PUT_RANK] =
        "INSERT OR REPLACE INTO ranks(rank, status, session_id, "
        "host, device, pid, step, root, units, alerts, "
        "transitions) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, "
        "?10, ?11)",
    [ST_ADD_ALERT] =
        "INSERT INTO alerts(rank, message, time_ms, kind) "
        "VALUES (?1, ?2, ?3, ?4)",
    [ST_PUT_INCARNATION] =
        "INSERT OR REPLACE INTO incarnations(number, started_ms, ended, "
        "ended_ms, has_rank, rank, exit_code, signal, reason, "
        "max_restarts, completed, world_size) VALUES (?1, ?2, ?3, ?4, ?5, "
        "?6, ?7, ?8, ?9, ?10, ?11, ?12)",
};

static const char k_schema[] =
    "CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT "
    "NULL);"
    "CREATE TABLE IF NOT EXISTS store(key BLOB PRIMARY KEY, value BLOB NOT "
    "NULL, version INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS ranks(rank INTEGER PRIMARY KEY, status "
    "INTEGER, session_id TEXT, host TEXT, device TEXT, pid INTEGER, step "
    "INTEGER, root INTEGER, units BLOB, alerts INTEGER, transitions "
    "INTEGER);"
    "CREATE TABLE IF NOT EXISTS alerts(id INTEGER PRIMARY KEY, rank INTEGER, "
    "message TEXT, time_ms INTEGER, kind INTEGER NOT NULL DEFAULT 0);"
    "CREATE TABLE IF NOT EXISTS requests(id TEXT PRIMARY KEY, response BLOB "
    "NOT NULL);"
    "CREATE TABLE IF NOT EXISTS incarnations(number INTEGER PRIMARY KEY, "
    "started_ms INTEGER, ended INTEGER, ended_ms INTEGER, has_rank INTEGER, "
    "rank INTEGER, exit_code INTEGER, signal INTEGER, reason TEXT, "
    "max_restarts INTEGER, completed INTEGER NOT NULL DEFAULT 0, "
    "world_size INTEGER NOT NULL DEFAULT 0);";

struct sp_coord_db {
  sqlite3 *h;
  sqlite3_stmt *st[ST_N];
  int lock_fd;
  bool in_txn;
  uint64_t req_puts; /* since the last prune */
  char dir[DIR_MAX];
  sp_diag err;
};

/* The check of every SQLite result: each goes through it. SQLITE_OK,
 * SQLITE_ROW and SQLITE_DONE pass; anything else becomes SP_EIO with
 * SQLite's message and where in this file it happened. */
static int db_check(sp_coord_db *db, int rc, const char *what, const char *file,
                    int line, sp_diag *d) {
  if (rc == SQLITE_OK || rc == SQLITE_ROW || rc == SQLITE_DONE) return 0;
  const char *base = strrchr(file, '/');
  sp_diag_set(&db->err, SP_EIO, "state dir %s: %s: %s (%s:%d)", db->dir, what,
              db->h ? sqlite3_errmsg(db->h) : sqlite3_errstr(rc),
              base ? base + 1 : file, line);
  if (d != NULL) *d = db->err;
  return SP_EIO;
}
#define CHECK(db, rc, what, d) \
  db_check((db), (rc), (what), __FILE__, __LINE__, (d))
/* Keeps the first failing bind's code in acc, for one CHECK after them. */
#define BIND(acc, call)                 \
  do {                                  \
    int b_ = (call);                    \
    if ((acc) == SQLITE_OK) (acc) = b_; \
  } while (0)

const char *sp_coord_db_dir(const sp_coord_db *db) { return db->dir; }
const char *sp_coord_db_error(const sp_coord_db *db) { return db->err.msg; }
bool sp_coord_db_in_txn(const sp_coord_db *db) { return db->in_txn; }

uint64_t sp_coord_db_hash(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= UINT64_C(0x100000001b3);
  }
  return h;
}

static int exec(sp_coord_db *db, const char *sql, sp_diag *d) {
  return CHECK(db, sqlite3_exec(db->h, sql, NULL, NULL, NULL), sql, d);
}

/* Runs a prepared statement that returns no rows (unless a bind failed:
 * `bound`), then resets it. */
static int step_done(sp_coord_db *db, sqlite3_stmt *s, int bound,
                     const char *what) {
  int rc = bound != SQLITE_OK ? bound : sqlite3_step(s);
  int err = CHECK(db, rc == SQLITE_ROW ? SQLITE_MISUSE : rc, what, NULL);
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  return err;
}

static int begin(sp_coord_db *db) {
  if (db->in_txn) return 0;
  int rc = exec(db, "BEGIN IMMEDIATE", NULL);
  if (rc == 0) db->in_txn = true;
  return rc;
}

int sp_coord_db_commit(sp_coord_db *db, sp_diag *d) {
  if (!db->in_txn) return 0;
  int rc = exec(db, "COMMIT", d);
  if (rc == 0) db->in_txn = false;
  return rc;
}

void sp_coord_db_rollback(sp_coord_db *db) {
  if (!db->in_txn) return;
  sqlite3_exec(db->h, "ROLLBACK", NULL, NULL, NULL);
  db->in_txn = false;
}

/* ---- opening: lock, schema, job identity ---- */

static int lock_dir(sp_coord_db *db, sp_diag *d) {
  char path[DIR_MAX + 32];
  snprintf(path, sizeof path, "%s/%s", db->dir, LOCK_FILE);
  db->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (db->lock_fd < 0)
    return sp_diag_set(d, SP_EIO, "state dir %s: cannot open %s: %s", db->dir,
                       LOCK_FILE, strerror(errno));
  if (flock(db->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    char pid[32] = "";
    ssize_t n = pread(db->lock_fd, pid, sizeof pid - 1, 0);
    pid[n > 0 ? n : 0] = '\0';
    pid[strcspn(pid, "\n")] = '\0';
    close(db->lock_fd);
    db->lock_fd = -1;
    if (e == EWOULDBLOCK)
      return sp_diag_set(
          d, SP_EEXIST, "state dir %s is in use by another coordinator%s%s%s",
          db->dir, pid[0] ? " (pid " : "", pid, pid[0] ? ")" : "");
    return sp_diag_set(d, SP_EIO, "state dir %s: cannot lock %s: %s", db->dir,
                       LOCK_FILE, strerror(e));
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(db->lock_fd, 0) != 0 ||
      pwrite(db->lock_fd, pid, (size_t)n, 0) != n) {
    /* the pid is only for the message above; the lock is what counts */
  }
  return 0;
}

static int meta_get(sp_coord_db *db, const char *name, char *out, size_t cap,
                    bool *found, sp_diag *d) {
  sqlite3_stmt *s = NULL;
  int rc =
      CHECK(db,
            sqlite3_prepare_v2(db->h, "SELECT value FROM meta WHERE name = ?1",
                               -1, &s, NULL),
            "read the job identity", d);
  if (rc != 0) return rc;
  int r = sqlite3_bind_text(s, 1, name, -1, SQLITE_STATIC);
  if (r == SQLITE_OK) r = sqlite3_step(s);
  *found = r == SQLITE_ROW;
  if (*found) {
    const unsigned char *v = sqlite3_column_text(s, 0);
    int n = sqlite3_column_bytes(s, 0);
    if (v == NULL || n < 0 || (size_t)n >= cap)
      rc = sp_diag_set(d, SP_EFORMAT, "state dir %s: meta %s of %d bytes",
                       db->dir, name, n);
    else
      memcpy(out, v, (size_t)n + 1);
  } else {
    rc = CHECK(db, r, "read the job identity", d);
  }
  sqlite3_finalize(s);
  return rc;
}

static int meta_put(sp_coord_db *db, const char *name, const char *value,
                    sp_diag *d) {
  sqlite3_stmt *s = NULL;
  int rc = CHECK(db,
                 sqlite3_prepare_v2(db->h,
                                    "INSERT OR REPLACE INTO meta(name, value) "
                                    "VALUES (?1, ?2)",
                                    -1, &s, NULL),
                 "write the job identity", d);
  if (rc != 0) return rc;
  int r = sqlite3_bind_text(s, 1, name, -1, SQLITE_STATIC);
  BIND(r, sqlite3_bind_text(s, 2, value, -1, SQLITE_STATIC));
  if (r == SQLITE_OK) r = sqlite3_step(s);
  rc = CHECK(db, r, "write the job identity", d);
  sqlite3_finalize(s);
  return rc;
}

/* A new database takes the job's identity; an existing one must have it. */
static int check_job(sp_coord_db *db, const sp_coord_db_job *job, bool *fresh,
                     sp_diag *d) {
  char world[16], hash[24];
  snprintf(world, sizeof world, "%" PRIu32, job->world_size);
  snprintf(hash, sizeof hash, "%016" PRIx64, job->spec_hash);
  const struct {
    const char *name, *value, *what;
  } f[] = {{"format", FORMAT, "format"},
           {"plan_version", job->plan_version, "plan version"},
           {"model", job->model_name, "model"},
           {"spec_hash", hash, "model spec hash"},
           {"world_size", world, "world size"}};
  char have[META_MAX];
  bool found;
  int rc = meta_get(db, "format", have, sizeof have, &found, d);
  if (rc != 0) return rc;
  *fresh = !found;
  if (*fresh) {
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
      if ((rc = meta_put(db, f[i].name, f[i].value, d)) != 0) return rc;
    return 0;
  }
  /* every difference named, not only the first */
  char diff[SP_DIAG_MAX] = "";
  size_t used = 0;
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    if ((rc = meta_get(db, f[i].name, have, sizeof have, &found, d)) != 0)
      return rc;
    if (found && strcmp(have, f[i].value) == 0) continue;
    int n = snprintf(diff + used, sizeof diff - used,
                     "%sits %s is %s, this "
                     "job's is %s",
                     used ? "; " : "", f[i].what, found ? have : "(none)",
                     f[i].value);
    if (n > 0)
      used +=
          (size_t)n < sizeof diff - used ? (size_t)n : sizeof diff - used - 1;
  }
  if (used > 0)
    return sp_diag_set(d, SP_EMISMATCH,
                       "state dir %s belongs to another job: %s", db->dir,
                       diff);
  return 0;
}

/* WAL or nothing: synchronous=NORMAL keeps committed transactions across a
 * process crash only in WAL mode, and SQLite answers with the mode it
 * could set rather than failing (some file systems cannot do WAL). */
static int set_wal(sp_coord_db *db, sp_diag *d) {
  sqlite3_stmt *s;
  int rc = CHECK(
      db, sqlite3_prepare_v2(db->h, "PRAGMA journal_mode=WAL", -1, &s, NULL),
      "set WAL mode", d);
  if (rc != 0) return rc;
  int r = sqlite3_step(s);
  if (r == SQLITE_ROW) {
    const unsigned char *mode = sqlite3_column_text(s, 0);
    if (mode == NULL || strcmp((const char *)mode, "wal") != 0)
      rc = sp_diag_set(d, SP_EUNSUPPORTED,
                       "state dir %s: SQLite cannot use WAL mode there "
                       "(journal mode %s)",
                       db->dir, mode ? (const char *)mode : "?");
  } else {
    rc = CHECK(db, r, "set WAL mode", d);
  }
  sqlite3_finalize(s);
  return rc;
}

int sp_coord_db_open(const char *dir, const sp_coord_db_job *job,
                     sp_coord_db **out, bool *fresh, sp_diag *d) {
  if (dir == NULL || dir[0] == '\0' || job == NULL || out == NULL ||
      fresh == NULL)
    return sp_diag_set(d, SP_EINVAL, "state dir: a directory is needed");
  if (strlen(dir) >= DIR_MAX)
    return sp_diag_set(d, SP_ETOOBIG, "state dir: a path of %zu bytes",
                       strlen(dir));
  sp_coord_db *db = calloc(1, sizeof *db);
  if (db == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  db->lock_fd = -1;
  snprintf(db->dir, sizeof db->dir, "%s", dir);
  int rc;
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
    rc = sp_diag_set(d, SP_EIO, "state dir %s: cannot create it: %s", dir,
                     strerror(errno));
    goto fail;
  }
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    rc = sp_diag_set(d, SP_EINVAL, "state dir %s is not a directory", dir);
    goto fail;
  }
  if ((rc = lock_dir(db, d)) != 0) goto fail;
  char path[DIR_MAX + 32];
  snprintf(path, sizeof path, "%s/%s", dir, DB_FILE);
  rc = CHECK(db,
             sqlite3_open_v2(path, &db->h,
                             SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE |
                                 SQLITE_OPEN_NOMUTEX,
                             NULL),
             "open " DB_FILE, d);
  if (rc != 0) goto fail;
  /* the lock file already keeps other coordinators out; this covers any
   * other reader (an operator's sqlite3 shell) holding the file briefly */
  sqlite3_busy_timeout(db->h, 2000);
  if ((rc = set_wal(db, d)) != 0 ||
      (rc = exec(db, "PRAGMA synchronous=NORMAL", d)) != 0 ||
      (rc = exec(db, k_schema, d)) != 0 ||
      (rc = check_job(db, job, fresh, d)) != 0)
    goto fail;
  /* an alert log written before alerts had kinds: the column is added
   * (SQLite refuses a second one, which is the case to ignore) */
  sqlite3_exec(db->h,
               "ALTER TABLE alerts ADD COLUMN kind INTEGER NOT NULL DEFAULT 0",
               NULL, NULL, NULL);
  /* and incarnations before a completed job was recorded as such */
  sqlite3_exec(db->h,
               "ALTER TABLE incarnations ADD COLUMN completed INTEGER NOT "
               "NULL DEFAULT 0",
               NULL, NULL, NULL);
  /* and before elastic nodes (0: the job's configured world) */
  sqlite3_exec(db->h,
               "ALTER TABLE incarnations ADD COLUMN world_size INTEGER NOT "
               "NULL DEFAULT 0",
               NULL, NULL, NULL);
  for (int i = 0; i < ST_N; i++)
    if ((rc = CHECK(
             db,
             sqlite3_prepare_v3(db->h, k_sql[i], -1, SQLITE_PREPARE_PERSISTENT,
                                &db->st[i], NULL),
             k_sql[i], d)) != 0)
      goto fail;
  *out = db;
  return 0;
fail:
  sp_coord_db_close(db);
  return rc;
}

void sp_coord_db_close(sp_coord_db *db) {
  if (db == NULL) return;
  sp_coord_db_rollback(db);
  for (int i = 0; i < ST_N; i++) sqlite3_finalize(db->st[i]);
  if (db->h != NULL) sqlite3_close(db->h);
  if (db->lock_fd >= 0) close(db->lock_fd);
  free(db);
}

/* ---- writes ---- */

int sp_coord_db_put_key(sp_coord_db *db, const void *key, size_t klen,
                        const void *value, size_t vlen, uint64_t version) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_PUT_KEY];
  BIND(bound, sqlite3_bind_blob(s, 1, key, (int)klen, SQLITE_STATIC));
  /* zeroblob for an empty value: a NULL blob would break NOT NULL */
  if (vlen == 0)
    BIND(bound, sqlite3_bind_zeroblob(s, 2, 0));
  else
    BIND(bound, sqlite3_bind_blob(s, 2, value, (int)vlen, SQLITE_STATIC));
  BIND(bound, sqlite3_bind_int64(s, 3, (sqlite3_int64)version));
  return step_done(db, s, bound, "write a store key");
}

int sp_coord_db_del_key(sp_coord_db *db, const void *key, size_t klen) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_DEL_KEY];
  BIND(bound, sqlite3_bind_blob(s, 1, key, (int)klen, SQLITE_STATIC));
  return step_done(db, s, bound, "delete a store key");
}

int sp_coord_db_put_request(sp_coord_db *db, const char *id,
                            const uint8_t *resp, size_t len) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_PUT_REQ];
  BIND(bound, sqlite3_bind_text(s, 1, id, -1, SQLITE_STATIC));
  if (len == 0)
    BIND(bound, sqlite3_bind_zeroblob(s, 2, 0));
  else
    BIND(bound, sqlite3_bind_blob(s, 2, resp, (int)len, SQLITE_STATIC));
  if ((rc = step_done(db, s, bound, "record a request id")) != 0) return rc;
  /* A retry comes within the worker's grace period; far older ids are
   * dead weight. Prune in bulk, not per insert. */
  if (++db->req_puts >= SP_COORD_DB_REQUESTS_KEPT / 10) {
    db->req_puts = 0;
    sqlite3_int64 last = sqlite3_last_insert_rowid(db->h);
    if (last > SP_COORD_DB_REQUESTS_KEPT) {
      s = db->st[ST_PRUNE_REQ];
      BIND(bound, sqlite3_bind_int64(s, 1, last - SP_COORD_DB_REQUESTS_KEPT));
      rc = step_done(db, s, bound, "prune request ids");
    }
  }
  return rc;
}

int sp_coord_db_get_request(sp_coord_db *db, const char *id, size_t max_len,
                            uint8_t **resp, size_t *len) {
  sqlite3_stmt *s = db->st[ST_GET_REQ];
  int r = sqlite3_bind_text(s, 1, id, -1, SQLITE_STATIC);
  if (r == SQLITE_OK) r = sqlite3_step(s);
  int rc = 0;
  if (r == SQLITE_ROW) {
    const void *b = sqlite3_column_blob(s, 0);
    int n = sqlite3_column_bytes(s, 0);
    if (n < 0 || (size_t)n > max_len) {
      rc = SP_ETOOBIG;
    } else {
      uint8_t *copy = malloc(n > 0 ? (size_t)n : 1);
      if (copy == NULL) {
        rc = SP_ENOMEM;
      } else {
        if (n > 0) memcpy(copy, b, (size_t)n);
        *resp = copy;
        *len = (size_t)n;
        rc = 1;
      }
    }
  } else {
    rc = CHECK(db, r, "look up a request id", NULL);
  }
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  return rc;
}

int sp_coord_db_put_rank(sp_coord_db *db, const sp_coord_db_rank *r) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_PUT_RANK];
  BIND(bound, sqlite3_bind_int64(s, 1, r->rank));
  BIND(bound, sqlite3_bind_int(s, 2, r->status));
  BIND(bound, sqlite3_bind_text(s, 3, r->session_id ? r->session_id : "", -1,
                                SQLITE_STATIC));
  BIND(bound,
       sqlite3_bind_text(s, 4, r->host ? r->host : "", -1, SQLITE_STATIC));
  BIND(bound,
       sqlite3_bind_text(s, 5, r->device ? r->device : "", -1, SQLITE_STATIC));
  BIND(bound, sqlite3_bind_int64(s, 6, r->pid));
  BIND(bound, sqlite3_bind_int64(s, 7, (sqlite3_int64)r->step));
  BIND(bound, sqlite3_bind_int(s, 8, r->root));
  if (r->n_units == 0)
    BIND(bound, sqlite3_bind_zeroblob(s, 9, 0));
  else
    BIND(bound,
         sqlite3_bind_blob(s, 9, r->units, (int)r->n_units, SQLITE_STATIC));
  BIND(bound, sqlite3_bind_int64(s, 10, r->alerts));
  BIND(bound, sqlite3_bind_int64(s, 11, (sqlite3_int64)r->transitions));
  return step_done(db, s, bound, "write a rank");
}

int sp_coord_db_add_alert(sp_coord_db *db, uint32_t rank, int kind,
                          const char *msg, uint64_t time_ms) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_ADD_ALERT];
  BIND(bound, sqlite3_bind_int64(s, 1, rank));
  BIND(bound, sqlite3_bind_text(s, 2, msg ? msg : "", -1, SQLITE_STATIC));
  BIND(bound, sqlite3_bind_int64(s, 3, (sqlite3_int64)time_ms));
  BIND(bound, sqlite3_bind_int(s, 4, kind));
  return step_done(db, s, bound, "write an alert");
}

int sp_coord_db_put_incarnation(sp_coord_db *db,
                                const sp_coord_db_incarnation *r) {
  int rc = begin(db);
  if (rc != 0) return rc;
  int bound = SQLITE_OK;
  sqlite3_stmt *s = db->st[ST_PUT_INCARNATION];
  BIND(bound, sqlite3_bind_int64(s, 1, (sqlite3_int64)r->number));
  BIND(bound, sqlite3_bind_int64(s, 2, (sqlite3_int64)r->started_ms));
  BIND(bound, sqlite3_bind_int(s, 3, r->ended));
  BIND(bound, sqlite3_bind_int64(s, 4, (sqlite3_int64)r->ended_ms));
  BIND(bound, sqlite3_bind_int(s, 5, r->has_rank));
  BIND(bound, sqlite3_bind_int64(s, 6, r->rank));
  BIND(bound, sqlite3_bind_int(s, 7, r->exit_code));
  BIND(bound, sqlite3_bind_int(s, 8, r->signal));
  BIND(bound,
       sqlite3_bind_text(s, 9, r->reason ? r->reason : "", -1, SQLITE_STATIC));
  BIND(bound, sqlite3_bind_int64(s, 10, r->max_restarts));
  BIND(bound, sqlite3_bind_int(s, 11, r->completed));
  BIND(bound, sqlite3_bind_int64(s, 12, r->world_size));
  return step_done(db, s, bound, "write an incarnation");
}

/* ---- reads (at start) ---- */

static int prepare(sp_coord_db *db, const char *sql, sqlite3_stmt **s,
                   sp_diag *d) {
  return CHECK(db, sqlite3_prepare_v2(db->h, sql, -1, s, NULL), sql, d);
}

static uint64_t col_u64(sqlite3_stmt *s, int i) {
  sqlite3_int64 v = sqlite3_column_int64(s, i);
  return v < 0 ? 0 : (uint64_t)v;
}

int sp_coord_db_each_key(sp_coord_db *db,
                         int (*fn)(void *arg, const uint8_t *k, size_t kl,
                                   const uint8_t *v, size_t vl, uint64_t ver),
                         void *arg, sp_diag *d) {
  sqlite3_stmt *s;
  int rc = prepare(db, "SELECT key, value, version FROM store", &s, d);
  if (rc != 0) return rc;
  int r;
  while ((r = sqlite3_step(s)) == SQLITE_ROW) {
    const uint8_t *k = sqlite3_column_blob(s, 0);
    int kl = sqlite3_column_bytes(s, 0);
    const uint8_t *v = sqlite3_column_blob(s, 1);
    int vl = sqlite3_column_bytes(s, 1);
    if (k == NULL || kl <= 0 || vl < 0) {
      rc = sp_diag_set(d, SP_EFORMAT, "state dir %s: a malformed store row",
                       db->dir);
      break;
    }
    if ((rc = fn(arg, k, (size_t)kl, vl ? v : (const uint8_t *)"", (size_t)vl,
                 col_u64(s, 2))) != 0)
      break;
  }
  if (rc == 0) rc = CHECK(db, r, "read the store", d);
  sqlite3_finalize(s);
  return rc;
}

static const char *col_text(sqlite3_stmt *s, int i) {
  const unsigned char *t = sqlite3_column_text(s, i);
  return t ? (const char *)t : "";
}

int sp_coord_db_each_rank(sp_coord_db *db,
                          int (*fn)(void *arg, const sp_coord_db_rank *r),
                          void *arg, sp_diag *d) {
  sqlite3_stmt *s;
  int rc = prepare(db,
                   "SELECT rank, status, session_id, host, device, pid, step, "
                   "root, units, alerts, transitions FROM ranks ORDER BY rank",
                   &s, d);
  if (rc != 0) return rc;
  int r;
  while ((r = sqlite3_step(s)) == SQLITE_ROW) {
    sp_coord_db_rank k = {0};
    sqlite3_int64 rank = sqlite3_column_int64(s, 0);
    if (rank < 0 || rank > UINT32_MAX) {
      rc = sp_diag_set(d, SP_EFORMAT, "state dir %s: rank %lld", db->dir,
                       (long long)rank);
      break;
    }
    k.rank = (uint32_t)rank;
    k.status = sqlite3_column_int(s, 1);
    k.session_id = col_text(s, 2);
    k.host = col_text(s, 3);
    k.device = col_text(s, 4);
    k.pid = (uint32_t)col_u64(s, 5);
    k.step = col_u64(s, 6);
    k.root = sqlite3_column_int(s, 7);
    k.units = sqlite3_column_blob(s, 8);
    int nu = sqlite3_column_bytes(s, 8);
    k.n_units = nu > 0 ? (size_t)nu : 0;
    k.alerts = (uint32_t)col_u64(s, 9);
    k.transitions = col_u64(s, 10);
    if ((rc = fn(arg, &k)) != 0) break;
  }
  if (rc == 0) rc = CHECK(db, r, "read the ranks", d);
  sqlite3_finalize(s);
  return rc;
}

int sp_coord_db_each_alert(sp_coord_db *db, size_t last,
                           int (*fn)(void *arg, uint32_t rank, int kind,
                                     const char *msg, size_t len,
                                     uint64_t time_ms),
                           void *arg, uint64_t *total, sp_diag *d) {
  sqlite3_stmt *s;
  int rc = prepare(db, "SELECT count(*) FROM alerts", &s, d);
  if (rc != 0) return rc;
  int r = sqlite3_step(s);
  *total = r == SQLITE_ROW ? col_u64(s, 0) : 0;
  rc = CHECK(db, r, "count the alerts", d);
  sqlite3_finalize(s);
  if (rc != 0) return rc;
  if ((rc = prepare(db,
                    "SELECT rank, message, time_ms, kind FROM (SELECT id, "
                    "rank, message, time_ms, kind FROM alerts ORDER BY id "
                    "DESC LIMIT ?1) ORDER BY id",
                    &s, d)) != 0)
    return rc;
  r = sqlite3_bind_int64(s, 1, (sqlite3_int64)last);
  while (r == SQLITE_OK && (r = sqlite3_step(s)) == SQLITE_ROW) {
    int n = sqlite3_column_bytes(s, 1);
    if ((rc = fn(arg, (uint32_t)col_u64(s, 0), sqlite3_column_int(s, 3),
                 col_text(s, 1), n > 0 ? (size_t)n : 0, col_u64(s, 2))) != 0)
      break;
  }
  if (rc == 0) rc = CHECK(db, r, "read the alerts", d);
  sqlite3_finalize(s);
  return rc;
}

int sp_coord_db_each_incarnation(sp_coord_db *db,
                                 int (*fn)(void *arg,
                                           const sp_coord_db_incarnation *r),
                                 void *arg, sp_diag *d) {
  sqlite3_stmt *s;
  int rc = prepare(db,
                   "SELECT number, started_ms, ended, ended_ms, has_rank, "
                   "rank, exit_code, signal, reason, max_restarts, "
                   "completed, world_size FROM incarnations ORDER BY number",
                   &s, d);
  if (rc != 0) return rc;
  int r;
  while ((r = sqlite3_step(s)) == SQLITE_ROW) {
    sp_coord_db_incarnation k = {.number = col_u64(s, 0),
                                 .started_ms = col_u64(s, 1),
                                 .ended = sqlite3_column_int(s, 2) != 0,
                                 .ended_ms = col_u64(s, 3),
                                 .has_rank = sqlite3_column_int(s, 4) != 0,
                                 .rank = (uint32_t)col_u64(s, 5),
                                 .exit_code = sqlite3_column_int(s, 6),
                                 .signal = sqlite3_column_int(s, 7),
                                 .reason = col_text(s, 8),
                                 .max_restarts = (uint32_t)col_u64(s, 9),
                                 .completed = sqlite3_column_int(s, 10) != 0,
                                 .world_size = (uint32_t)col_u64(s, 11)};
    if ((rc = fn(arg, &k)) != 0) break;
  }
  if (rc == 0) rc = CHECK(db, r, "read the incarnations", d);
  sqlite3_finalize(s);
  return rc;
}
