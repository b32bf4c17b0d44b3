#include "fake_rank.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "base/sp_error.h"

#define PATH(m) SP_COORD_PATH(m)

void sp_fake_job_start(sp_coord_fixture *fx, const char *model,
                       const char *const *flags, char *version, size_t cap,
                       Shardplane__V1__GetJobResponse **got) {
  sp_coord_fixture_start(fx, model, flags, 0);
  Shardplane__V1__GetJobResponse *g = sp_coord_fixture_get_job(fx);
  snprintf(version, cap, "%s", g->plan_version);
  if (got != NULL)
    *got = g;
  else
    sp_test_free_msg(g);
}

void sp_fake_rank_attach(sp_fake_rank *f, sp_coord_fixture *fx,
                         const char *plan_version, uint32_t rank,
                         uint32_t world_size, const char *host) {
  memset(f, 0, sizeof *f);
  f->rank = rank;
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = rank;
  q.world_size = world_size;
  /* protobuf-c's strings are char * but only read when packing */
  q.host = (char *)host;
  q.pid = 1000 + rank;
  q.device = "cpu";
  q.plan_version = (char *)plan_version;
  sp_rpc_status st;
  Shardplane__V1__AttachResponse *a =
      (Shardplane__V1__AttachResponse *)sp_coord_fixture_call(
          fx, PATH("Attach"), &q.base,
          &shardplane__v1__attach_response__descriptor, &st);
  if (a == NULL) fail_msg("attach rank %u: %s", rank, st.message);
  snprintf(f->session, sizeof f->session, "%s", a->session_id);
  sp_test_free_msg(a);
  assert_int_equal(sp_rpc_sync_open(fx->addr, 2000, &f->cli), 0);
  assert_int_equal(
      sp_rpc_sync_stream_open(f->cli, PATH("Session"), 0, NULL, 0, &f->s), 0);
}

static void take(sp_fake_rank *f, const Shardplane__V1__SessionDown *d) {
  if (d->command == SHARDPLANE__V1__COMMAND__ABORT && !f->aborted) {
    f->aborted = true;
    f->has_culprit = d->has_culprit;
    f->culprit = d->culprit;
    snprintf(f->reason, sizeof f->reason, "%s", d->reason);
  } else if (d->command == SHARDPLANE__V1__COMMAND__FLIGHT_DUMP) {
    f->dump_asked = true;
    f->dump_after_abort |= f->aborted;
    f->dump_id = d->request_id;
    f->dump_last_n = d->last_n;
  }
}

void sp_fake_rank_drain(sp_fake_rank *f, uint64_t wait_ms) {
  ProtobufCMessage *m;
  sp_rpc_status st;
  if (wait_ms == 0) wait_ms = 1;
  while (sp_rpc_sync_stream_recv(f->s,
                                 &shardplane__v1__session_down__descriptor,
                                 wait_ms, &m, &st) == 0) {
    take(f, (Shardplane__V1__SessionDown *)m);
    sp_test_free_msg(m);
    wait_ms = 1;
  }
}

void sp_fake_rank_send_up(sp_fake_rank *f, Shardplane__V1__SessionUp *up) {
  up->rank = f->rank;
  up->session_id = f->session;
  up->seq = ++f->seq;
  int rc = sp_rpc_sync_stream_send(f->s, &up->base);
  if (rc != 0) fail_msg("rank %u: send: %s", f->rank, sp_strerror(rc));
  for (;;) {
    ProtobufCMessage *m;
    sp_rpc_status st;
    rc = sp_rpc_sync_stream_recv(
        f->s, &shardplane__v1__session_down__descriptor, 5000, &m, &st);
    if (rc != 0)
      fail_msg("rank %u: no ack of %llu: %s (%s)", f->rank,
               (unsigned long long)f->seq, sp_strerror(rc), st.message);
    Shardplane__V1__SessionDown *d = (Shardplane__V1__SessionDown *)m;
    /* an ABORT or FLIGHT_DUMP may come before the ack */
    take(f, d);
    bool acked = d->acked_seq >= f->seq;
    sp_test_free_msg(d);
    if (acked) break;
  }
}

void sp_fake_rank_transition(sp_fake_rank *f, int machine, uint32_t unit,
                             int state, uint64_t step, uint64_t time_us,
                             Shardplane__V1__SessionUp *up) {
  Shardplane__V1__SessionUp empty = SHARDPLANE__V1__SESSION_UP__INIT;
  if (up == NULL) up = &empty;
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = (Shardplane__V1__Machine)machine;
  t.unit = unit;
  t.state = state;
  t.step = step;
  t.time_us = time_us;
  Shardplane__V1__Transition *tp = &t;
  up->step = step;
  up->n_transitions = 1;
  up->transitions = &tp;
  sp_fake_rank_send_up(f, up);
  /* t lives on this stack only */
  up->n_transitions = 0;
  up->transitions = NULL;
}

void sp_fake_rank_close(sp_fake_rank *f) {
  if (f->s) sp_rpc_sync_stream_close(f->s);
  if (f->cli) sp_rpc_sync_close(f->cli);
  f->s = NULL;
  f->cli = NULL;
}
