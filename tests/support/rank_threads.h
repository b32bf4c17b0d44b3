/* Ranks as threads of the test process, each with its own session
 * against one coordinator and its own communicators (sp_fsdp_comms_open),
 * for tests of the FSDP runtime (test_fsdp.c, test_optim.c).
 *
 * cmocka's assertions longjmp, which is only valid on the test's own
 * thread, so a rank thread records its first failure (sp_test_rank_fail,
 * SP_RANK_CHECK, SP_RANK_CALL) and aborts every rank's communicators, so
 * that peers blocked in a collective fail at once instead of after its
 * timeout; the main thread asserts after joining them. */
#ifndef SP_TEST_RANK_THREADS_H
#define SP_TEST_RANK_THREADS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/shardplane.h"

#define SP_TEST_MAX_RANKS 8

typedef struct sp_test_ranks sp_test_ranks;

/* One rank's part of the harness. A test's own rank state begins with
 * one, so that its callbacks can cast back to that state. */
typedef struct sp_test_rank {
  sp_test_ranks *job; /* set by sp_test_ranks_start */
  uint32_t rank;      /* likewise */
  /* world, shard group, replica group (NULL: none), from
   * sp_test_rank_attach; under the job's lock, which aborts them */
  sp_comm *comm[3];
  bool failed;
  uint32_t fail_order; /* 1 for the first rank to fail, 2 next, ... */
  char msg[1024];      /* "rank R: FILE:LINE: what failed" */
} sp_test_rank;

struct sp_test_ranks {
  /* set by the caller before sp_test_ranks_start */
  uint32_t world;                        /* 1..SP_TEST_MAX_RANKS */
  sp_test_rank *rank[SP_TEST_MAX_RANKS]; /* the caller's, [0, world) */
  /* On each rank's thread: run (its failure recorded in the rank; what it
   * returns is not used), then finish. With hold, finish waits until
   * sp_test_ranks_join, so that the main thread can look at the job
   * between (sp_test_ranks_wait). */
  int (*run)(sp_test_rank *r);
  void (*finish)(sp_test_rank *r); /* NULL: none */
  bool hold;
  /* the harness's own */
  pthread_t th[SP_TEST_MAX_RANKS];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool aborted;      /* a rank failed: comms attached later are aborted */
  uint32_t failures; /* ranks failed so far */
  uint32_t arrived;  /* ranks done with run */
  bool released;
};

/* Starts one thread a rank, numbering the ranks (job and rank). Aborts
 * the test when a thread cannot be started. */
void sp_test_ranks_start(sp_test_ranks *job);
/* Waits until every rank is done with run: true when one has failed. */
bool sp_test_ranks_wait(sp_test_ranks *job);
/* Releases held ranks and joins every thread. Each failure goes to
 * stderr; the first (the cause: later ones are mostly peers whose
 * collectives it aborted) into first ("" when none). */
void sp_test_ranks_join(sp_test_ranks *job, char *first, size_t cap);

/* Records r's failure at file:line, unless it has one already, and aborts
 * every rank's communicators. Returns -1, for the rank to return. */
int sp_test_rank_fail(sp_test_rank *r, const char *file, int line,
                      const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Opens rank r's session with the coordinator at address (*s, the caller's
 * to close with sp_test_rank_detach) and its communicators (r->comm).
 * Returns 0, or -1 with the failure recorded. */
int sp_test_rank_attach(sp_test_rank *r, const char *address, sp_session **s);
/* Leaves and frees r's communicators, then closes s (NULL: none); a
 * failure is recorded unless r has one already. */
void sp_test_rank_detach(sp_test_rank *r, sp_session *s);

/* Fails rank r (an sp_test_rank *) unless cond holds. */
#define SP_RANK_CHECK(r, cond, ...)                                   \
  do {                                                                \
    if (!(cond))                                                      \
      return sp_test_rank_fail((r), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/* A call that must return 0; `expr` passes &D as its diag. */
#define SP_RANK_CALL(r, expr)                                                \
  do {                                                                       \
    sp_diag D = {""};                                                        \
    int rc_ = (expr);                                                        \
    if (rc_ != 0)                                                            \
      return sp_test_rank_fail((r), __FILE__, __LINE__, "%s: %s: %s", #expr, \
                               sp_err_name(rc_), D.msg);                     \
  } while (0)

/* Passes a failure already recorded up to the rank's run. */
#define SP_RANK_TRY(expr)       \
  do {                          \
    if ((expr) != 0) return -1; \
  } while (0)

#endif
