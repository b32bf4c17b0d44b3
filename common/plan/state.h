/* FSDP1 training-state machines as data.
 *
 * PyTorch FSDP1 keeps two state machines (torch/distributed/fsdp/
 * _common_utils.py): one `TrainingState` per FSDP state (here: per rank, the
 * root's) and one `HandleTrainingState` per FlatParamHandle (here: per unit).
 * shardplane keeps them as one table of legal transitions so that workers
 * (checking before they act) and the coordinator (validating every report)
 * cannot disagree. State values equal PyTorch's enum values and are part of
 * the wire protocol.
 *
 * Everything here is pure and thread-safe except sp_state_tracker, which is
 * a plain value that its owner must not share between threads unlocked.
 */
#ifndef SP_STATE_H
#define SP_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sp_machine {
  SP_MACHINE_ROOT = 0,   /* per rank: TrainingState */
  SP_MACHINE_HANDLE = 1, /* per unit: HandleTrainingState */
} sp_machine;

/* TrainingState (_common_utils.py). */
typedef enum sp_root_state {
  SP_ROOT_IDLE = 1,
  SP_ROOT_FORWARD_BACKWARD = 2,
  SP_ROOT_SUMMON_FULL_PARAMS = 3,
} sp_root_state;

/* HandleTrainingState (_common_utils.py). */
typedef enum sp_handle_state {
  SP_HANDLE_IDLE = 1,
  SP_HANDLE_FORWARD = 2,
  SP_HANDLE_BACKWARD_PRE = 3,
  SP_HANDLE_BACKWARD_POST = 4,
  SP_HANDLE_SUMMON_FULL_PARAMS = 5,
} sp_handle_state;

/* Largest state value of either machine: an `int out[SP_STATE_MAX]` always
 * holds every legal next state. States of a machine are 1..its max. */
#define SP_STATE_MAX 5

/* One row of the table. `event` names the PyTorch code path that performs
 * the transition (e.g. "pre_forward"); several rows may share a (from, to)
 * pair with different events. Static storage. */
typedef struct sp_state_transition {
  sp_machine machine;
  int from;
  int to;
  const char *event;
} sp_state_transition;

/* "root" / "handle"; "invalid" for other values. Never NULL. */
const char *sp_state_machine_name(sp_machine m);

bool sp_state_machine_valid(sp_machine m);

/* Highest state value of machine m (3 for root, 5 for handle); 0 if m is
 * invalid. */
int sp_state_max(sp_machine m);

bool sp_state_valid(sp_machine m, int state);

/* The PyTorch enum member name ("IDLE", "FORWARD_BACKWARD", ...), static
 * storage; "INVALID" for values not in machine m. Never NULL. */
const char *sp_state_name(sp_machine m, int state);

/* Parses a state name of machine m, case-insensitively, optionally prefixed
 * with the PyTorch class name ("TrainingState.IDLE",
 * "HandleTrainingState.FORWARD"). Returns 0 or SP_EINVAL; *out is untouched on
 * error. */
int sp_state_parse(sp_machine m, const char *name, int *out);

/* The whole table (both machines), in a stable order; *n receives the row
 * count. Static storage, never NULL. */
const sp_state_transition *sp_state_table(size_t *n);

/* First table row for (m, from, to), or NULL if the transition is illegal
 * (including any invalid argument). */
const sp_state_transition *sp_state_find(sp_machine m, int from, int to);

bool sp_state_transition_legal(sp_machine m, int from, int to);

/* Writes the distinct legal next states of `from`, ascending, into out[0..cap)
 * and returns how many there are in total (which may exceed cap; a cap of
 * SP_STATE_MAX is always enough). out may be NULL when cap is 0. Returns 0
 * for an invalid machine or state. */
size_t sp_state_legal_next(sp_machine m, int from, int *out, size_t cap);

/* Formats "illegal handle transition FORWARD -> BACKWARD_POST; legal from
 * FORWARD: IDLE" into d (which may be NULL) and returns SP_ESTATE. Invalid
 * state values are printed as numbers. Callers add context (rank, unit) with
 * sp_diag_prefix. */
int sp_state_transition_error(sp_diag *d, sp_machine m, int from, int to);

/* ---- per-rank tracker ----------------------------------------------------
 *
 * What one rank's state is: the root state plus one handle state per unit.
 * Used by workers (check before acting) and by the coordinator (one per
 * attached rank). Owned by the caller; init allocates `units`, free releases
 * it. */

/* Units per rank a tracker accepts; checked before allocating. */
#define SP_STATE_MAX_UNITS (1u << 20)

typedef struct sp_state_tracker {
  int root; /* sp_root_state */
  size_t n_units;
  /* n_units sp_handle_state values (one byte each: a coordinator keeps one
   * tracker per rank, thousands of them); NULL when n_units is 0 */
  uint8_t *units;
} sp_state_tracker;

/* Every state starts IDLE (as _init_core_state and FlatParamHandle.__init__
 * leave them). Returns 0, SP_EINVAL (t NULL), SP_ETOOBIG (n_units >
 * SP_STATE_MAX_UNITS) or SP_ENOMEM; on error *t is left empty and safe to
 * free. */
int sp_state_tracker_init(sp_state_tracker *t, size_t n_units, sp_diag *d);

/* Releases units; t becomes empty. t may be NULL. Safe to call twice. */
void sp_state_tracker_free(sp_state_tracker *t);

/* Current state of the root (m == SP_MACHINE_ROOT, unit ignored) or of
 * `unit`; 0 when unit is out of range or m invalid. */
int sp_state_tracker_get(const sp_state_tracker *t, sp_machine m, size_t unit);

/* Moves the root (unit ignored) or `unit` to `to` if the table allows it.
 * Returns 0; SP_ESTATE with the message of sp_state_transition_error
 * (prefixed "unit N" for handles) on an illegal transition; SP_EINVAL for an
 * invalid machine, unit index or state value. On any error the tracker is
 * unchanged. */
int sp_state_tracker_apply(sp_state_tracker *t, sp_machine m, size_t unit,
                           int to, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
