#include "state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Paths below are relative to torch/distributed/fsdp/ in pytorch/pytorch
 * (2023 and later layout).
 *
 * Some transitions are "from any state" because PyTorch's Python code
 * assigns without checking. Those rows are listed here only from
 * the states the real code path can be in when it runs; anything else in a
 * report means a desynchronised or buggy rank, which is what the coordinator
 * exists to catch.
 *
 * Deliberately absent:
 * - Assignments that leave the state unchanged and are only checks:
 *   `_lazy_init` (asserts root IDLE), `_post_backward_hook` on the FSDP state
 *   (`_assert_in_training_states(state, [FORWARD_BACKWARD])`), and the
 *   activation-checkpointing recompute in `_pre_forward`/`_post_forward`,
 *   which returns early while the handle is BACKWARD_PRE.
 * - `_unshard_fsdp_state_params` on a handle already in SUMMON_FULL_PARAMS:
 *   it yields without touching the state, so there is nothing to report.
 * - `_prefetch_handle`: it sets the target handle to FORWARD or BACKWARD_PRE
 *   only around its own `_unshard` call and restores the previous state
 *   before returning; no hook can observe it, so workers do not report it.
 */
static const sp_state_transition k_table[] = {
    /* ---- root: TrainingState of the rank's root FSDP state ---- */

    /* _runtime_utils.py :: _pre_forward sets FORWARD_BACKWARD. The root
     * enters its forward IDLE: the previous backward's final callback, the
     * previous _post_forward or construction (_init_utils.py ::
     * _init_core_state) left it so. */
    {SP_MACHINE_ROOT, SP_ROOT_IDLE, SP_ROOT_FORWARD_BACKWARD, "pre_forward"},
    /* _runtime_utils.py :: _post_forward sets IDLE. */
    {SP_MACHINE_ROOT, SP_ROOT_FORWARD_BACKWARD, SP_ROOT_IDLE, "post_forward"},
    /* _runtime_utils.py :: _pre_backward_hook on the root, first call of the
     * backward: _register_post_backward_final_callback asserts IDLE, then the
     * hook sets FORWARD_BACKWARD. */
    {SP_MACHINE_ROOT, SP_ROOT_IDLE, SP_ROOT_FORWARD_BACKWARD,
     "pre_backward_hook"},
    /* _runtime_utils.py :: _post_backward_final_callback sets every state in
     * _all_fsdp_states to IDLE. It was queued by the root's pre-backward hook,
     * so the root is FORWARD_BACKWARD when it runs. */
    {SP_MACHINE_ROOT, SP_ROOT_FORWARD_BACKWARD, SP_ROOT_IDLE,
     "post_backward_final_callback"},
    /* _unshard_param_utils.py :: _unshard_params_for_summon raises from
     * FORWARD_BACKWARD ("Cannot manually unshard parameters during
     * forward/backward") and from SUMMON_FULL_PARAMS ("... when already
     * unsharding parameters"), then sets SUMMON_FULL_PARAMS. */
    {SP_MACHINE_ROOT, SP_ROOT_IDLE, SP_ROOT_SUMMON_FULL_PARAMS,
     "summon_full_params_enter"},
    /* Same function, `finally:` clause: back to IDLE. */
    {SP_MACHINE_ROOT, SP_ROOT_SUMMON_FULL_PARAMS, SP_ROOT_IDLE,
     "summon_full_params_exit"},

    /* ---- handle: HandleTrainingState of each unit's FlatParamHandle ---- */

    /* _runtime_utils.py :: _pre_forward sets FORWARD (skipped while
     * BACKWARD_PRE: activation-checkpointing recompute). */
    {SP_MACHINE_HANDLE, SP_HANDLE_IDLE, SP_HANDLE_FORWARD, "pre_forward"},
    /* _runtime_utils.py :: _post_forward sets IDLE after resharding and
     * registering the pre-backward hooks on the outputs. */
    {SP_MACHINE_HANDLE, SP_HANDLE_FORWARD, SP_HANDLE_IDLE, "post_forward"},
    /* _runtime_utils.py :: _pre_backward_hook (once per backward, guarded by
     * _ran_pre_backward_hook) sets BACKWARD_PRE;
     * FlatParamHandle.prepare_gradient_for_backward asserts {BACKWARD_PRE,
     * IDLE}. */
    {SP_MACHINE_HANDLE, SP_HANDLE_IDLE, SP_HANDLE_BACKWARD_PRE,
     "pre_backward_hook"},
    /* _runtime_utils.py :: _post_backward_hook: _p_assert in (BACKWARD_PRE,
     * BACKWARD_POST), then sets BACKWARD_POST. */
    {SP_MACHINE_HANDLE, SP_HANDLE_BACKWARD_PRE, SP_HANDLE_BACKWARD_POST,
     "post_backward_hook"},
    /* Same hook again: reentrant activation checkpointing across submodules
     * sharing one FlatParameter runs it more than once per backward. */
    {SP_MACHINE_HANDLE, SP_HANDLE_BACKWARD_POST, SP_HANDLE_BACKWARD_POST,
     "post_backward_hook"},
    /* _runtime_utils.py :: _post_backward_final_callback sets every handle
     * IDLE after _catch_all_reshard and _finalize_params. Handles whose
     * gradient was computed are BACKWARD_POST; a handle whose flat parameter
     * got no gradient stays BACKWARD_PRE; a handle whose outputs needed no
     * gradient never ran its pre-backward hook and is still IDLE. */
    {SP_MACHINE_HANDLE, SP_HANDLE_BACKWARD_POST, SP_HANDLE_IDLE,
     "post_backward_final_callback"},
    {SP_MACHINE_HANDLE, SP_HANDLE_BACKWARD_PRE, SP_HANDLE_IDLE,
     "post_backward_final_callback"},
    {SP_MACHINE_HANDLE, SP_HANDLE_IDLE, SP_HANDLE_IDLE,
     "post_backward_final_callback"},
    /* _unshard_param_utils.py :: _unshard_fsdp_state_params asserts IDLE
     * ("Expects the handle training to be IDLE") and sets
     * SUMMON_FULL_PARAMS; used by summon_full_params and the state-dict
     * hooks. */
    {SP_MACHINE_HANDLE, SP_HANDLE_IDLE, SP_HANDLE_SUMMON_FULL_PARAMS,
     "summon_full_params_enter"},
    /* Same function, `finally:` clause: writeback if requested, reshard,
     * IDLE. */
    {SP_MACHINE_HANDLE, SP_HANDLE_SUMMON_FULL_PARAMS, SP_HANDLE_IDLE,
     "summon_full_params_exit"},
};

#define K_TABLE_LEN (sizeof k_table / sizeof k_table[0])

/* Indexed by state value; slot 0 is unused because PyTorch numbers from 1. */
static const char *const k_root_names[] = {NULL, "IDLE", "FORWARD_BACKWARD",
                                           "SUMMON_FULL_PARAMS"};
static const char *const k_handle_names[] = {
    NULL,           "IDLE",          "FORWARD",
    "BACKWARD_PRE", "BACKWARD_POST", "SUMMON_FULL_PARAMS"};

_Static_assert(sizeof k_handle_names / sizeof k_handle_names[0] ==
                   SP_STATE_MAX + 1,
               "SP_STATE_MAX must be the largest state value");

bool sp_state_machine_valid(sp_machine m) {
  return m == SP_MACHINE_ROOT || m == SP_MACHINE_HANDLE;
}

const char *sp_state_machine_name(sp_machine m) {
  switch (m) {
    case SP_MACHINE_ROOT: return "root";
    case SP_MACHINE_HANDLE: return "handle";
  }
  return "invalid";
}

int sp_state_max(sp_machine m) {
  switch (m) {
    case SP_MACHINE_ROOT: return SP_ROOT_SUMMON_FULL_PARAMS;
    case SP_MACHINE_HANDLE: return SP_HANDLE_SUMMON_FULL_PARAMS;
  }
  return 0;
}

bool sp_state_valid(sp_machine m, int state) {
  return state >= 1 && state <= sp_state_max(m);
}

const char *sp_state_name(sp_machine m, int state) {
  if (!sp_state_valid(m, state)) return "INVALID";
  return m == SP_MACHINE_ROOT ? k_root_names[state] : k_handle_names[state];
}

int sp_state_parse(sp_machine m, const char *name, int *out) {
  if (name == NULL || out == NULL || !sp_state_machine_valid(m))
    return SP_EINVAL;
  const char *cls =
      m == SP_MACHINE_ROOT ? "TrainingState." : "HandleTrainingState.";
  size_t cls_len = strlen(cls);
  if (strncasecmp(name, cls, cls_len) == 0) name += cls_len;
  for (int s = 1; s <= sp_state_max(m); s++) {
    if (strcasecmp(name, sp_state_name(m, s)) == 0) {
      *out = s;
      return 0;
    }
  }
  return SP_EINVAL;
}

const sp_state_transition *sp_state_table(size_t *n) {
  if (n != NULL) *n = K_TABLE_LEN;
  return k_table;
}

const sp_state_transition *sp_state_find(sp_machine m, int from, int to) {
  if (!sp_state_valid(m, from) || !sp_state_valid(m, to)) return NULL;
  for (size_t i = 0; i < K_TABLE_LEN; i++) {
    const sp_state_transition *r = &k_table[i];
    if (r->machine == m && r->from == from && r->to == to) return r;
  }
  return NULL;
}

bool sp_state_transition_legal(sp_machine m, int from, int to) {
  return sp_state_find(m, from, to) != NULL;
}

size_t sp_state_legal_next(sp_machine m, int from, int *out, size_t cap) {
  if (!sp_state_valid(m, from)) return 0;
  size_t n = 0;
  /* Walking target values in order dedupes rows that share (from, to) and
   * gives a stable, ascending answer. */
  for (int to = 1; to <= sp_state_max(m); to++) {
    if (!sp_state_transition_legal(m, from, to)) continue;
    if (out != NULL && n < cap) out[n] = to;
    n++;
  }
  return n;
}

/* Appends a state's name, or its number when it is not a state of m, so a
 * corrupt report still produces a readable line. */
static const char *state_label(sp_machine m, int s, char *buf, size_t len) {
  if (sp_state_valid(m, s)) return sp_state_name(m, s);
  snprintf(buf, len, "%d", s);
  return buf;
}

int sp_state_transition_error(sp_diag *d, sp_machine m, int from, int to) {
  if (d == NULL) return SP_ESTATE;
  char fbuf[16], tbuf[16];
  const char *fname = state_label(m, from, fbuf, sizeof fbuf);
  const char *tname = state_label(m, to, tbuf, sizeof tbuf);

  char legal[128] = "";
  int next[SP_STATE_MAX];
  size_t n = sp_state_legal_next(m, from, next, SP_STATE_MAX);
  size_t used = 0;
  for (size_t i = 0; i < n && used < sizeof legal; i++) {
    int w = snprintf(legal + used, sizeof legal - used, "%s%s",
                     i > 0 ? ", " : "", sp_state_name(m, next[i]));
    if (w < 0) break;
    used += (size_t)w;
  }
  if (n == 0) snprintf(legal, sizeof legal, "none");

  return sp_diag_set(d, SP_ESTATE,
                     "illegal %s transition %s -> %s; legal from %s: %s",
                     sp_state_machine_name(m), fname, tname, fname, legal);
}

/* ---- tracker ------------------------------------------------------------ */

int sp_state_tracker_init(sp_state_tracker *t, size_t n_units, sp_diag *d) {
  if (t == NULL) return sp_diag_set(d, SP_EINVAL, "state tracker is NULL");
  t->root = SP_ROOT_IDLE;
  t->n_units = 0;
  t->units = NULL;
  if (n_units > SP_STATE_MAX_UNITS) {
    return sp_diag_set(d, SP_ETOOBIG, "%zu units exceed the limit of %u",
                       n_units, SP_STATE_MAX_UNITS);
  }
  if (n_units == 0) return 0;
  uint8_t *units = malloc(n_units * sizeof *units);
  if (units == NULL) {
    return sp_diag_set(d, SP_ENOMEM, "cannot allocate states for %zu units",
                       n_units);
  }
  for (size_t i = 0; i < n_units; i++) units[i] = SP_HANDLE_IDLE;
  t->units = units;
  t->n_units = n_units;
  return 0;
}

void sp_state_tracker_free(sp_state_tracker *t) {
  if (t == NULL) return;
  free(t->units);
  t->units = NULL;
  t->n_units = 0;
}

int sp_state_tracker_get(const sp_state_tracker *t, sp_machine m, size_t unit) {
  if (t == NULL) return 0;
  if (m == SP_MACHINE_ROOT) return t->root;
  if (m == SP_MACHINE_HANDLE && unit < t->n_units) return t->units[unit];
  return 0;
}

int sp_state_tracker_apply(sp_state_tracker *t, sp_machine m, size_t unit,
                           int to, sp_diag *d) {
  if (t == NULL) return sp_diag_set(d, SP_EINVAL, "state tracker is NULL");
  if (!sp_state_machine_valid(m)) {
    return sp_diag_set(d, SP_EINVAL, "invalid state machine %d", (int)m);
  }
  if (m == SP_MACHINE_HANDLE && unit >= t->n_units) {
    return sp_diag_set(d, SP_EINVAL, "unit %zu out of range (%zu units)", unit,
                       t->n_units);
  }
  if (!sp_state_valid(m, to)) {
    return sp_diag_set(d, SP_EINVAL, "invalid %s state %d",
                       sp_state_machine_name(m), to);
  }
  int from = m == SP_MACHINE_ROOT ? t->root : t->units[unit];
  if (!sp_state_transition_legal(m, from, to)) {
    int rc = sp_state_transition_error(d, m, from, to);
    if (m == SP_MACHINE_HANDLE) rc = sp_diag_prefix(d, rc, "unit %zu", unit);
    return rc;
  }
  if (m == SP_MACHINE_ROOT)
    t->root = to;
  else
    t->units[unit] = (uint8_t)to;
  return 0;
}
