#include "rank_threads.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

static void abort_all(sp_test_ranks *job) {
  pthread_mutex_lock(&job->mu);
  job->aborted = true;
  for (uint32_t r = 0; r < job->world; r++)
    for (int k = 0; k < 3; k++)
      if (job->rank[r]->comm[k]) sp_comm_abort(job->rank[r]->comm[k]);
  pthread_mutex_unlock(&job->mu);
}

int sp_test_rank_fail(sp_test_rank *r, const char *file, int line,
                      const char *fmt, ...) {
  if (!r->failed) {
    r->failed = true;
    pthread_mutex_lock(&r->job->mu);
    r->fail_order = ++r->job->failures;
    pthread_mutex_unlock(&r->job->mu);
    int n = snprintf(r->msg, sizeof r->msg, "rank %u: %s:%d: ", r->rank, file,
                     line);
    if (n < 0 || (size_t)n >= sizeof r->msg) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->msg + n, sizeof r->msg - (size_t)n, fmt, ap);
    va_end(ap);
  }
  abort_all(r->job);
  return -1;
}

int sp_test_rank_attach(sp_test_rank *r, const char *address, sp_session **s) {
  sp_session_opts so = {
      .coordinator = address, .rank = r->rank, .connect_timeout_ms = 10000};
  SP_RANK_CALL(r, sp_session_open(&so, s, &D));
  sp_comm *cs[3] = {NULL, NULL, NULL};
  SP_RANK_CALL(r, sp_fsdp_comms_open(*s, 20000, &cs[0], &cs[1], &cs[2], &D));
  pthread_mutex_lock(&r->job->mu);
  for (int k = 0; k < 3; k++) {
    r->comm[k] = cs[k];
    /* a peer that failed before these existed could not abort them */
    if (r->job->aborted && cs[k]) sp_comm_abort(cs[k]);
  }
  pthread_mutex_unlock(&r->job->mu);
  return 0;
}

void sp_test_rank_detach(sp_test_rank *r, sp_session *s) {
  sp_diag d = {""};
  /* leave together: a member that closed while a peer still finished the
   * last collective would fail it (0 at once when aborted) */
  sp_comm *cs[3] = {r->comm[0], r->comm[1], r->comm[2]};
  for (int k = 0; k < 3; k++)
    if (cs[k] && sp_comm_leave(cs[k], &d) != 0 && !r->failed)
      sp_test_rank_fail(r, __FILE__, __LINE__, "sp_comm_leave: %s", d.msg);
  pthread_mutex_lock(&r->job->mu);
  for (int k = 0; k < 3; k++) r->comm[k] = NULL;
  pthread_mutex_unlock(&r->job->mu);
  for (int k = 3; k-- > 0;) sp_comm_free(cs[k]);
  if (s && sp_session_close(s, 5000, &d) != 0 && !r->failed)
    sp_test_rank_fail(r, __FILE__, __LINE__, "sp_session_close: %s", d.msg);
}

static void *rank_main(void *arg) {
  sp_test_rank *r = arg;
  sp_test_ranks *job = r->job;
  (void)job->run(r);
  pthread_mutex_lock(&job->mu);
  job->arrived++;
  pthread_cond_broadcast(&job->cv);
  while (job->hold && !job->released) pthread_cond_wait(&job->cv, &job->mu);
  pthread_mutex_unlock(&job->mu);
  if (job->finish) job->finish(r);
  return NULL;
}

void sp_test_ranks_start(sp_test_ranks *job) {
  assert_true(job->world >= 1 && job->world <= SP_TEST_MAX_RANKS);
  pthread_mutex_init(&job->mu, NULL);
  pthread_cond_init(&job->cv, NULL);
  job->aborted = job->released = false;
  job->failures = job->arrived = 0;
  for (uint32_t r = 0; r < job->world; r++) {
    job->rank[r]->job = job;
    job->rank[r]->rank = r;
  }
  for (uint32_t r = 0; r < job->world; r++)
    assert_int_equal(pthread_create(&job->th[r], NULL, rank_main, job->rank[r]),
                     0);
}

bool sp_test_ranks_wait(sp_test_ranks *job) {
  pthread_mutex_lock(&job->mu);
  while (job->arrived < job->world) pthread_cond_wait(&job->cv, &job->mu);
  bool failed = job->aborted;
  pthread_mutex_unlock(&job->mu);
  return failed;
}

void sp_test_ranks_join(sp_test_ranks *job, char *first, size_t cap) {
  pthread_mutex_lock(&job->mu);
  job->released = true;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
  for (uint32_t r = 0; r < job->world; r++) pthread_join(job->th[r], NULL);
  first[0] = '\0';
  for (uint32_t r = 0; r < job->world; r++)
    if (job->rank[r]->failed) {
      fprintf(stderr, "%s\n", job->rank[r]->msg);
      if (job->rank[r]->fail_order == 1)
        snprintf(first, cap, "%s", job->rank[r]->msg);
    }
  pthread_mutex_destroy(&job->mu);
  pthread_cond_destroy(&job->cv);
}
