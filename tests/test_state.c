/* Tests for the FSDP1 training-state tables and the per-rank tracker. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "plan/state.h"
#include "support/testutil.h"

enum { N_UNITS = 4 };

static const char *const k_strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD",
                                           "_HYBRID_SHARD_ZERO2"};

/* Names the scenario in failure messages. */
static const char *g_ctx = "";

static void apply_ok(sp_state_tracker *t, sp_machine m, size_t unit, int to) {
  sp_diag d = {{0}};
  int rc = sp_state_tracker_apply(t, m, unit, to, &d);
  if (rc != 0) fail_msg("%s: unexpected rejection: %s", g_ctx, d.msg);
}

static void assert_all(const sp_state_tracker *t, int root, int handle) {
  assert_int_equal(sp_state_tracker_get(t, SP_MACHINE_ROOT, 0), root);
  for (size_t u = 0; u < t->n_units; u++) {
    assert_int_equal(sp_state_tracker_get(t, SP_MACHINE_HANDLE, u), handle);
  }
}

/* Root pre-backward hook, then units in reverse forward order, then the
 * root's final callback resetting everything. */
static void backward(sp_state_tracker *t) {
  apply_ok(t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  for (size_t u = t->n_units; u-- > 0;) {
    apply_ok(t, SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_PRE);
    apply_ok(t, SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_POST);
  }
  for (size_t u = 0; u < t->n_units; u++) {
    apply_ok(t, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
  }
  apply_ok(t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
}

/* Every strategy drives the same machines; only the collectives differ. */
static void test_normal_step_every_strategy(void **state) {
  (void)state;
  for (size_t s = 0; s < sizeof k_strategies / sizeof k_strategies[0]; s++) {
    g_ctx = k_strategies[s];
    sp_state_tracker t;
    assert_int_equal(sp_state_tracker_init(&t, N_UNITS, NULL), 0);
    assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
    for (int step = 0; step < 3; step++) {
      apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
      for (size_t u = 0; u < N_UNITS; u++) {
        apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_FORWARD);
        apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
      }
      apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
      assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
      backward(&t);
      assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
    }
    sp_state_tracker_free(&t);
  }
  g_ctx = "";
}

/* The wrapper path nests: the root unit's forward encloses its children. */
static void test_nested_forward(void **state) {
  (void)state;
  sp_state_tracker t;
  assert_int_equal(sp_state_tracker_init(&t, N_UNITS, NULL), 0);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  apply_ok(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_FORWARD);
  for (size_t u = 1; u < N_UNITS; u++) {
    apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_FORWARD);
    apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
  }
  apply_ok(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
  backward(&t);
  assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
  sp_state_tracker_free(&t);
}

/* Gradient accumulation (two forwards, one backward), a unit that got no
 * gradient (stays BACKWARD_PRE), a unit whose outputs needed none (never
 * leaves IDLE) and reentrant checkpointing (post-backward twice). */
static void test_backward_variants(void **state) {
  (void)state;
  sp_state_tracker t;
  assert_int_equal(sp_state_tracker_init(&t, 3, NULL), 0);
  for (int fwd = 0; fwd < 2; fwd++) {
    apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
    for (size_t u = 0; u < 3; u++) {
      apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_FORWARD);
      apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
    }
    apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
  }
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_BACKWARD_PRE);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_BACKWARD_POST);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_BACKWARD_POST);
  apply_ok(&t, SP_MACHINE_HANDLE, 1, SP_HANDLE_BACKWARD_PRE);
  /* unit 0 never ran its pre-backward hook */
  apply_ok(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_HANDLE, 1, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
  assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
  sp_state_tracker_free(&t);
}

static void test_summon_enter_exit(void **state) {
  (void)state;
  sp_state_tracker t;
  assert_int_equal(sp_state_tracker_init(&t, N_UNITS, NULL), 0);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS);
  for (size_t u = 0; u < N_UNITS; u++) {
    apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_SUMMON_FULL_PARAMS);
  }
  for (size_t u = 0; u < N_UNITS; u++) {
    apply_ok(&t, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
  }
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
  assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
  /* state-dict hooks summon handles without touching the root */
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_SUMMON_FULL_PARAMS);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_IDLE);
  sp_state_tracker_free(&t);
}

/* Applies an illegal transition and checks the code, the exact message and
 * that nothing moved. */
static void expect_reject(sp_state_tracker *t, sp_machine m, size_t unit,
                          int to, const char *msg) {
  int root = t->root;
  uint8_t units[N_UNITS];
  assert_true(t->n_units <= N_UNITS);
  memcpy(units, t->units, t->n_units * sizeof *units);
  sp_diag d = {{0}};
  assert_int_equal(sp_state_tracker_apply(t, m, unit, to, &d), SP_ESTATE);
  assert_string_equal(d.msg, msg);
  assert_int_equal(t->root, root);
  assert_memory_equal(t->units, units, t->n_units * sizeof *units);
  /* NULL diag is allowed */
  assert_int_equal(sp_state_tracker_apply(t, m, unit, to, NULL), SP_ESTATE);
}

static void test_illegal_transitions(void **state) {
  (void)state;
  sp_state_tracker t;
  assert_int_equal(sp_state_tracker_init(&t, N_UNITS, NULL), 0);

  expect_reject(&t, SP_MACHINE_HANDLE, 1, SP_HANDLE_BACKWARD_POST,
                "unit 1: illegal handle transition IDLE -> BACKWARD_POST; "
                "legal from IDLE: IDLE, FORWARD, BACKWARD_PRE, "
                "SUMMON_FULL_PARAMS");
  expect_reject(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE,
                "illegal root transition IDLE -> IDLE; legal from IDLE: "
                "FORWARD_BACKWARD, SUMMON_FULL_PARAMS");

  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  apply_ok(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_FORWARD);
  expect_reject(&t, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS,
                "illegal root transition FORWARD_BACKWARD -> "
                "SUMMON_FULL_PARAMS; legal from FORWARD_BACKWARD: IDLE");
  expect_reject(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD,
                "illegal root transition FORWARD_BACKWARD -> "
                "FORWARD_BACKWARD; legal from FORWARD_BACKWARD: IDLE");
  expect_reject(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_BACKWARD_POST,
                "unit 0: illegal handle transition FORWARD -> BACKWARD_POST; "
                "legal from FORWARD: IDLE");
  expect_reject(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_SUMMON_FULL_PARAMS,
                "unit 0: illegal handle transition FORWARD -> "
                "SUMMON_FULL_PARAMS; legal from FORWARD: IDLE");
  apply_ok(&t, SP_MACHINE_HANDLE, 0, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);

  /* backward: no forward from BACKWARD_PRE/POST, no skipping back */
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  apply_ok(&t, SP_MACHINE_HANDLE, 3, SP_HANDLE_BACKWARD_PRE);
  expect_reject(&t, SP_MACHINE_HANDLE, 3, SP_HANDLE_FORWARD,
                "unit 3: illegal handle transition BACKWARD_PRE -> FORWARD; "
                "legal from BACKWARD_PRE: IDLE, BACKWARD_POST");
  apply_ok(&t, SP_MACHINE_HANDLE, 3, SP_HANDLE_BACKWARD_POST);
  expect_reject(&t, SP_MACHINE_HANDLE, 3, SP_HANDLE_BACKWARD_PRE,
                "unit 3: illegal handle transition BACKWARD_POST -> "
                "BACKWARD_PRE; legal from BACKWARD_POST: IDLE, "
                "BACKWARD_POST");
  apply_ok(&t, SP_MACHINE_HANDLE, 3, SP_HANDLE_IDLE);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);

  /* double summon, and no training while summoned */
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS);
  apply_ok(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_SUMMON_FULL_PARAMS);
  expect_reject(&t, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS,
                "illegal root transition SUMMON_FULL_PARAMS -> "
                "SUMMON_FULL_PARAMS; legal from SUMMON_FULL_PARAMS: IDLE");
  expect_reject(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD,
                "illegal root transition SUMMON_FULL_PARAMS -> "
                "FORWARD_BACKWARD; legal from SUMMON_FULL_PARAMS: IDLE");
  expect_reject(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_SUMMON_FULL_PARAMS,
                "unit 2: illegal handle transition SUMMON_FULL_PARAMS -> "
                "SUMMON_FULL_PARAMS; legal from SUMMON_FULL_PARAMS: IDLE");
  expect_reject(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_FORWARD,
                "unit 2: illegal handle transition SUMMON_FULL_PARAMS -> "
                "FORWARD; legal from SUMMON_FULL_PARAMS: IDLE");
  sp_state_tracker_free(&t);
}

static void test_error_format(void **state) {
  (void)state;
  sp_diag d = {{0}};
  assert_int_equal(
      sp_state_transition_error(&d, SP_MACHINE_HANDLE, SP_HANDLE_FORWARD,
                                SP_HANDLE_BACKWARD_POST),
      SP_ESTATE);
  assert_string_equal(d.msg,
                      "illegal handle transition FORWARD -> "
                      "BACKWARD_POST; legal from FORWARD: IDLE");
  assert_int_equal(sp_state_transition_error(NULL, SP_MACHINE_ROOT, 1, 1),
                   SP_ESTATE);
  /* values that are no state still give a readable line */
  sp_state_transition_error(&d, SP_MACHINE_ROOT, 7, -1);
  assert_string_equal(d.msg,
                      "illegal root transition 7 -> -1; legal from 7: none");
}

static void test_tracker_bad_arguments(void **state) {
  (void)state;
  sp_state_tracker t;
  sp_diag d = {{0}};
  assert_int_equal(sp_state_tracker_init(&t, 2, &d), 0);
  assert_int_equal(
      sp_state_tracker_apply(&t, SP_MACHINE_HANDLE, 2, SP_HANDLE_FORWARD, &d),
      SP_EINVAL);
  assert_non_null(strstr(d.msg, "unit 2 out of range"));
  assert_int_equal(sp_state_tracker_apply(&t, SP_MACHINE_HANDLE, 0, 6, &d),
                   SP_EINVAL);
  /* a handle-only value is no root state */
  assert_int_equal(sp_state_tracker_apply(&t, SP_MACHINE_ROOT, 0,
                                          SP_HANDLE_BACKWARD_POST, &d),
                   SP_EINVAL);
  assert_non_null(strstr(d.msg, "invalid root state 4"));
  assert_int_equal(
      sp_state_tracker_apply(&t, (sp_machine)9, 0, SP_ROOT_IDLE, &d),
      SP_EINVAL);
  assert_int_equal(sp_state_tracker_apply(NULL, SP_MACHINE_ROOT, 0,
                                          SP_ROOT_FORWARD_BACKWARD, &d),
                   SP_EINVAL);
  assert_int_equal(sp_state_tracker_get(&t, SP_MACHINE_HANDLE, 5), 0);
  assert_all(&t, SP_ROOT_IDLE, SP_HANDLE_IDLE);
  sp_state_tracker_free(&t);
  sp_state_tracker_free(&t);
  assert_null(t.units);

  assert_int_equal(sp_state_tracker_init(&t, SP_STATE_MAX_UNITS + 1u, &d),
                   SP_ETOOBIG);
  assert_null(t.units);
  sp_state_tracker_free(&t);
  assert_int_equal(sp_state_tracker_init(&t, 0, &d), 0);
  assert_null(t.units);
  apply_ok(&t, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  sp_state_tracker_free(&t);
  assert_int_equal(sp_state_tracker_init(NULL, 1, &d), SP_EINVAL);
}

static void test_names_round_trip(void **state) {
  (void)state;
  const sp_machine ms[] = {SP_MACHINE_ROOT, SP_MACHINE_HANDLE};
  char buf[64];
  for (size_t i = 0; i < 2; i++) {
    sp_machine m = ms[i];
    for (int s = 1; s <= sp_state_max(m); s++) {
      const char *name = sp_state_name(m, s);
      int out = 0;
      assert_int_equal(sp_state_parse(m, name, &out), 0);
      assert_int_equal(out, s);
      /* lower case and the PyTorch class prefix */
      size_t n = strlen(name);
      assert_true(n < sizeof buf);
      for (size_t k = 0; k <= n; k++) {
        char c = name[k];
        buf[k] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
      }
      out = 0;
      assert_int_equal(sp_state_parse(m, buf, &out), 0);
      assert_int_equal(out, s);
      snprintf(buf, sizeof buf, "%s%s",
               m == SP_MACHINE_ROOT ? "TrainingState." : "HandleTrainingState.",
               name);
      out = 0;
      assert_int_equal(sp_state_parse(m, buf, &out), 0);
      assert_int_equal(out, s);
    }
    assert_string_equal(sp_state_name(m, 0), "INVALID");
    assert_string_equal(sp_state_name(m, sp_state_max(m) + 1), "INVALID");
  }
  assert_int_equal(sp_state_max(SP_MACHINE_ROOT), 3);
  assert_int_equal(sp_state_max(SP_MACHINE_HANDLE), 5);
  assert_string_equal(sp_state_name(SP_MACHINE_HANDLE, 3), "BACKWARD_PRE");
  assert_string_equal(sp_state_name(SP_MACHINE_ROOT, 3), "SUMMON_FULL_PARAMS");

  int out = 42;
  assert_int_equal(sp_state_parse(SP_MACHINE_ROOT, "FORWARD", &out), SP_EINVAL);
  assert_int_equal(sp_state_parse(SP_MACHINE_HANDLE, "FORWARD_BACKWARD", &out),
                   SP_EINVAL);
  assert_int_equal(
      sp_state_parse(SP_MACHINE_ROOT, "HandleTrainingState.IDLE", &out),
      SP_EINVAL);
  assert_int_equal(sp_state_parse(SP_MACHINE_ROOT, "", &out), SP_EINVAL);
  assert_int_equal(sp_state_parse(SP_MACHINE_ROOT, NULL, &out), SP_EINVAL);
  assert_int_equal(out, 42);
  assert_string_equal(sp_state_machine_name(SP_MACHINE_ROOT), "root");
  assert_string_equal(sp_state_machine_name(SP_MACHINE_HANDLE), "handle");
  assert_string_equal(sp_state_machine_name((sp_machine)5), "invalid");
}

static void test_table_consistency(void **state) {
  (void)state;
  size_t n = 0;
  const sp_state_transition *tab = sp_state_table(&n);
  assert_non_null(tab);
  assert_true(n > 0);
  for (size_t i = 0; i < n; i++) {
    assert_true(sp_state_machine_valid(tab[i].machine));
    assert_true(sp_state_valid(tab[i].machine, tab[i].from));
    assert_true(sp_state_valid(tab[i].machine, tab[i].to));
    assert_non_null(tab[i].event);
    assert_true(tab[i].event[0] != '\0');
    assert_true(
        sp_state_transition_legal(tab[i].machine, tab[i].from, tab[i].to));
    for (size_t j = i + 1; j < n; j++) {
      bool same = tab[i].machine == tab[j].machine &&
                  tab[i].from == tab[j].from && tab[i].to == tab[j].to &&
                  strcmp(tab[i].event, tab[j].event) == 0;
      if (same) fail_msg("duplicate rows %zu and %zu", i, j);
    }
  }

  /* Every state of both machines is reachable from IDLE and returns to
   * IDLE: a small fixpoint over the table. */
  const sp_machine ms[] = {SP_MACHINE_ROOT, SP_MACHINE_HANDLE};
  for (size_t k = 0; k < 2; k++) {
    sp_machine m = ms[k];
    bool fwd[SP_STATE_MAX + 1] = {false}, back[SP_STATE_MAX + 1] = {false};
    fwd[1] = back[1] = true;
    for (int round = 0; round < SP_STATE_MAX; round++) {
      for (size_t i = 0; i < n; i++) {
        if (tab[i].machine != m) continue;
        if (fwd[tab[i].from]) fwd[tab[i].to] = true;
        if (back[tab[i].to]) back[tab[i].from] = true;
      }
    }
    for (int s = 1; s <= sp_state_max(m); s++) {
      assert_true(fwd[s]);
      assert_true(back[s]);
    }
  }

  /* legal_next: deduped, ascending, counts past cap */
  int next[SP_STATE_MAX];
  assert_int_equal(
      sp_state_legal_next(SP_MACHINE_ROOT, SP_ROOT_IDLE, next, SP_STATE_MAX),
      2);
  assert_int_equal(next[0], SP_ROOT_FORWARD_BACKWARD);
  assert_int_equal(next[1], SP_ROOT_SUMMON_FULL_PARAMS);
  int one[1] = {0};
  assert_int_equal(
      sp_state_legal_next(SP_MACHINE_HANDLE, SP_HANDLE_IDLE, one, 1), 4);
  assert_int_equal(one[0], SP_HANDLE_IDLE);
  assert_int_equal(
      sp_state_legal_next(SP_MACHINE_HANDLE, SP_HANDLE_IDLE, NULL, 0), 4);
  assert_int_equal(sp_state_legal_next(SP_MACHINE_HANDLE, 0, next, 5), 0);
  assert_int_equal(sp_state_legal_next(SP_MACHINE_ROOT, 4, next, 5), 0);

  const sp_state_transition *r = sp_state_find(
      SP_MACHINE_HANDLE, SP_HANDLE_BACKWARD_POST, SP_HANDLE_BACKWARD_POST);
  assert_non_null(r);
  assert_string_equal(r->event, "post_backward_hook");
  assert_null(sp_state_find(SP_MACHINE_ROOT, SP_ROOT_FORWARD_BACKWARD,
                            SP_ROOT_FORWARD_BACKWARD));
  assert_false(sp_state_transition_legal(SP_MACHINE_ROOT, 0, 1));
  assert_false(sp_state_transition_legal((sp_machine)3, 1, 1));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_normal_step_every_strategy),
      cmocka_unit_test(test_nested_forward),
      cmocka_unit_test(test_backward_variants),
      cmocka_unit_test(test_summon_enter_exit),
      cmocka_unit_test(test_illegal_transitions),
      cmocka_unit_test(test_error_format),
      cmocka_unit_test(test_tracker_bad_arguments),
      cmocka_unit_test(test_names_round_trip),
      cmocka_unit_test(test_table_consistency),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
