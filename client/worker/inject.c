/* --inject: the parser and the hooks (inject.h has the faults). */
#include "inject.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/flag.h"

static const char *const k_kinds[] = {"stall", "skip-collective", "wrong-count",
                                      "slow", "exit"};

/* Which keys each kind takes: required, then optional. */
enum { K_RANK = 1, K_STEP = 2, K_UNIT = 4, K_PHASE = 8, K_FACTOR = 16 };
static const unsigned k_required[] = {K_RANK | K_STEP, K_RANK | K_STEP,
                                      K_RANK | K_STEP, K_RANK | K_FACTOR,
                                      K_RANK | K_STEP};
static const unsigned k_optional[] = {K_UNIT | K_PHASE, K_UNIT, 0, 0, 0};
static const char *const k_keys[] = {"rank", "step", "unit", "phase", "factor"};
static const char *const k_usage[] = {
    "stall:rank=R,step=S[,unit=U,phase=forward|backward]",
    "skip-collective:rank=R,step=S[,unit=U]", "wrong-count:rank=R,step=S",
    "slow:rank=R,factor=F", "exit:rank=R,step=S"};

static int fail(sp_diag *d, const char *spec, const char *fmt, const char *a,
                const char *b) {
  char why[512];
  snprintf(why, sizeof why, fmt, a, b);
  return sp_flag_fail(d, "--inject", spec, "%s", why);
}

/* An integer in [min, max] for key, named in the error. */
static int int_value(const char *spec, const char *key, const char *v,
                     long long min, long long max, long long *out, sp_diag *d) {
  char *end;
  errno = 0;
  long long n = strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno != 0 || n < min || n > max) {
    char range[96];
    snprintf(range, sizeof range, "an integer in [%lld, %lld]", min, max);
    return fail(d, spec, "%s: expected %s", key, range);
  }
  *out = n;
  return 0;
}

int sp_inject_parse(sp_inject *in, const char *spec, sp_diag *d) {
  if (in->n >= SP_INJECT_MAX)
    return sp_flag_fail(d, "--inject", spec, "at most %d faults",
                        SP_INJECT_MAX);
  char buf[512];
  if (strlen(spec) >= sizeof buf)
    return sp_flag_fail(d, "--inject", spec, "at most %zu bytes",
                        sizeof buf - 1);
  strcpy(buf, spec);
  char *colon = strchr(buf, ':');
  if (colon) *colon = '\0';
  size_t kind = 0;
  while (kind < 5 && strcmp(buf, k_kinds[kind]) != 0) kind++;
  if (kind == 5)
    return sp_flag_fail(d, "--inject", spec,
                        "KIND:KEY=VALUE,... with KIND one of stall, "
                        "skip-collective, wrong-count, slow, exit");
  if (!colon || colon[1] == '\0')
    return fail(d, spec, "expected %s%s", k_usage[kind], "");
  sp_inject_fault f = {.kind = (sp_inject_kind)kind, .factor = 1};
  unsigned seen = 0;
  char *save = NULL;
  for (char *kv = strtok_r(colon + 1, ",", &save); kv;
       kv = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq)
      return fail(d, spec, "\"%s\": expected KEY=VALUE (%s)", kv,
                  k_usage[kind]);
    *eq = '\0';
    const char *v = eq + 1;
    unsigned key = 0;
    for (unsigned i = 0; i < 5; i++)
      if (strcmp(kv, k_keys[i]) == 0) key = 1u << i;
    if (!(key & (k_required[kind] | k_optional[kind])))
      return fail(d, spec, "%s takes no key \"%s\"", k_kinds[kind], kv);
    if (seen & key) return fail(d, spec, "%s given twice", kv, "");
    seen |= key;
    long long n = 0;
    int rc = 0;
    switch (key) {
      case K_RANK:
        rc = int_value(spec, "rank", v, 0, SP_JOB_MAX_WORLD - 1, &n, d);
        f.rank = (uint32_t)n;
        break;
      case K_STEP:
        rc = int_value(spec, "step", v, 1, 1000000000, &n, d);
        f.step = (uint64_t)n;
        break;
      case K_UNIT:
        rc = int_value(spec, "unit", v, 0, UINT32_MAX, &n, d);
        f.unit = (uint32_t)n;
        f.has_unit = true;
        break;
      case K_PHASE:
        if (strcmp(v, "forward") == 0)
          f.phase = SP_PHASE_FORWARD;
        else if (strcmp(v, "backward") == 0)
          f.phase = SP_PHASE_BACKWARD;
        else
          rc = fail(d, spec,
                    "phase: expected forward or backward, got "
                    "\"%s\"%s",
                    v, "");
        break;
      case K_FACTOR: {
        char *end;
        double x = strtod(v, &end);
        if (*v == '\0' || *end != '\0' || !(x >= 1) || x > 1000)
          rc = fail(d, spec,
                    "factor: expected a number in [1, 1000], got "
                    "\"%s\"%s",
                    v, "");
        f.factor = x;
        break;
      }
      default: break;
    }
    if (rc < 0) return rc;
  }
  unsigned missing = k_required[kind] & ~seen;
  for (unsigned i = 0; i < 5; i++)
    if (missing & (1u << i))
      return fail(d, spec, "%s is required (%s)", k_keys[i], k_usage[kind]);
  in->faults[in->n++] = f;
  return 0;
}

void sp_inject_start(sp_inject *in, sp_session *s, uint32_t rank) {
  in->s = s;
  in->rank = rank;
  in->slow = 1;
  in->hooks = false;
  for (size_t i = 0; i < in->n; i++) {
    const sp_inject_fault *f = &in->faults[i];
    if (f->rank != rank) continue;
    if (f->kind == SP_INJECT_SLOW) in->slow *= f->factor;
    if (f->kind == SP_INJECT_STALL || f->kind == SP_INJECT_SKIP ||
        f->kind == SP_INJECT_WRONG_COUNT)
      in->hooks = true;
  }
}

bool sp_inject_wants_hook(const sp_inject *in) { return in->hooks; }

/* Whether the agent (or run) started this worker again (SHARDPLANE_RESTART
 * above 0): a new incarnation, or its replica group rejoining. */
static bool restarted(void) {
  const char *v = getenv(SP_RESTART_ENV);
  return v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
}

void sp_inject_step(sp_inject *in, uint64_t step) {
  in->step = step;
  /* a drill's death happens once: a restarted worker that passes the step
   * again (a group rejoining just before it, or a restart from an earlier
   * checkpoint) carries on */
  if (restarted()) return;
  for (size_t i = 0; i < in->n; i++) {
    const sp_inject_fault *f = &in->faults[i];
    if (f->rank == in->rank && f->kind == SP_INJECT_EXIT && f->step == step) {
      fprintf(stderr,
              "shardplane-worker: rank %u: --inject exit: dying at "
              "the start of step %llu\n",
              in->rank, (unsigned long long)step);
      fflush(stderr);
      _exit(1);
    }
  }
}

static void sleep_s(double s) {
  if (!(s > 0)) return;
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void sp_inject_after_step(const sp_inject *in, double seconds) {
  if (in->slow > 1) sleep_s((in->slow - 1) * seconds);
}

/* Blocks until the job is aborted (the session got ABORT or lost the
 * coordinator), while the session's thread keeps sending heartbeats: to
 * the coordinator this rank is alive but makes no progress. */
static int stall(sp_inject *in, const sp_inject_fault *f, uint32_t unit) {
  fprintf(stderr,
          "shardplane-worker: rank %u: --inject stall: blocking "
          "before unit %u's collective at step %llu\n",
          in->rank, unit, (unsigned long long)f->step);
  fflush(stderr);
  while (!sp_session_aborted(in->s, NULL, 0)) sleep_s(0.02);
  return SP_ECANCELED;
}

int sp_inject_before_collective(void *user, sp_fsdp_phase phase,
                                sp_comm_kind comm, sp_coll_op op, uint32_t unit,
                                uint64_t *count) {
  sp_inject *in = user;
  if (restarted()) return 0; /* a drill's fault happens once */
  for (size_t i = 0; i < in->n; i++) {
    sp_inject_fault *f = &in->faults[i];
    if (f->fired || f->rank != in->rank || f->step != in->step) continue;
    if (f->has_unit && f->unit != unit) continue;
    switch (f->kind) {
      case SP_INJECT_STALL:
        /* a unit's collective: the sums between steps (the stop check,
         * the loss) are no unit's */
        if (phase == SP_PHASE_OTHER ||
            (f->phase != SP_PHASE_OTHER && f->phase != phase))
          break;
        f->fired = true;
        return stall(in, f, unit);
      case SP_INJECT_SKIP:
        if (op != SP_OP_ALL_GATHER) break;
        f->fired = true;
        fprintf(stderr,
                "shardplane-worker: rank %u: --inject "
                "skip-collective: skipping unit %u's all-gather at step "
                "%llu\n",
                in->rank, unit, (unsigned long long)in->step);
        return 1;
      case SP_INJECT_WRONG_COUNT:
        /* a unit's reduction, the one collective whose count the runtime
         * lets a hook lower (never the replica group's second half) */
        if (phase != SP_PHASE_BACKWARD || comm == SP_COMM_REPLICA ||
            (op != SP_OP_REDUCE_SCATTER && op != SP_OP_ALL_REDUCE) ||
            *count < 2)
          break;
        f->fired = true;
        fprintf(stderr,
                "shardplane-worker: rank %u: --inject wrong-count: "
                "unit %u's reduction at step %llu with %llu elements, not "
                "%llu\n",
                in->rank, unit, (unsigned long long)in->step,
                (unsigned long long)(*count - 1), (unsigned long long)*count);
        *count -= 1;
        return 0;
      default: break;
    }
  }
  return 0;
}
