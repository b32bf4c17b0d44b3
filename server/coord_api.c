/* The dashboard's JSON API. Answers are written by a small JSON writer
 * over an sp_textbuf rather than built as jansson trees: the rank table
 * is one value per rank and column (1.2 million at 100,000 ranks, where a
 * tree would cost an allocation each), and jansson refuses a string that
 * is not valid UTF-8 (a host name is whatever a rank sent), where an
 * answer must still come, the bytes replaced. */
#include "coord_api.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/strmap.h"
#include "base/suggest.h"
#include "base/textbuf.h"
#include "cast/dtype.h"
#include "coord_agents.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_diag.h"
#include "coord_history.h"
#include "coord_plan.h"
#include "coord_ranks.h"
#include "coord_straggler.h"
#include "coord_verdict.h"
#include "plan/state.h"

static const char k_json[] = "application/json";

/* ---- the writer ---- */

typedef struct jw {
  sp_textbuf b;
  /* bit d: nothing written yet in the container open at depth d (the
   * answers nest a few levels deep) */
  uint64_t fresh;
  int depth;
} jw;

static void jw_init(jw *w, size_t reserve) {
  sp_textbuf_init(&w->b, SP_COORD_API_MAX_BODY);
  if (reserve) sp_textbuf_reserve(&w->b, reserve);
  w->fresh = 0;
  w->depth = 0;
}

static void put(jw *w, const char *s, size_t n) { sp_textbuf_put(&w->b, s, n); }
static void puts_(jw *w, const char *s) { sp_textbuf_puts(&w->b, s); }
static void putc_(jw *w, char ch) { sp_textbuf_put(&w->b, &ch, 1); }

/* The length of the valid UTF-8 sequence at s (1 to 4 bytes: no overlong
 * form, surrogate or code point past U+10FFFF), 0 when there is none. A
 * NUL ends the checks before any byte past it is read. */
static size_t utf8_len(const unsigned char *s) {
  unsigned c = s[0];
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) return (s[1] & 0xc0) == 0x80 ? 2 : 0;
  if (c >= 0xe0 && c <= 0xef) {
    unsigned lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    return s[1] >= lo && s[1] <= hi && (s[2] & 0xc0) == 0x80 ? 3 : 0;
  }
  if (c >= 0xf0 && c <= 0xf4) {
    unsigned lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    return s[1] >= lo && s[1] <= hi && (s[2] & 0xc0) == 0x80 &&
                   (s[3] & 0xc0) == 0x80
               ? 4
               : 0;
  }
  return 0;
}

/* s as a JSON string, from at most about max of its bytes (a sequence
 * that starts before max is kept whole). Control characters and " \ are
 * escaped as JSON needs, < > & too (no answer reads as markup, whatever
 * sniffs it), and a byte that is not UTF-8 becomes U+FFFD. */
static void jw_escaped(jw *w, const char *str, size_t max) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0, run = 0;
  putc_(w, '"');
  while (i < max && s[i] != '\0') {
    unsigned c = s[i];
    if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\' && c != '<' &&
        c != '>' && c != '&') {
      i++;
      continue;
    }
    put(w, str + run, i - run);
    if (c < 0x80) {
      char e[8];
      if (c == '"' || c == '\\')
        snprintf(e, sizeof e, "\\%c", (char)c);
      else if (c == '\n')
        snprintf(e, sizeof e, "\\n");
      else
        snprintf(e, sizeof e, "\\u%04x", c);
      puts_(w, e);
      i++;
    } else {
      size_t n = utf8_len(s + i);
      if (n > 0) {
        put(w, str + i, n);
        i += n;
      } else {
        puts_(w, "\\ufffd");
        i++;
      }
    }
    run = i;
  }
  put(w, str + run, i - run);
  putc_(w, '"');
}

/* Before a value: the comma after the container's last one, and the key
 * (a constant of this file, written as is) inside an object. */
static void jw_sep(jw *w, const char *key) {
  uint64_t bit = (uint64_t)1 << w->depth;
  if (w->fresh & bit)
    w->fresh &= ~bit;
  else if (w->depth > 0)
    putc_(w, ',');
  if (key != NULL) {
    putc_(w, '"');
    puts_(w, key);
    put(w, "\":", 2);
  }
}

static void jw_open(jw *w, const char *key, char brace) {
  jw_sep(w, key);
  putc_(w, brace);
  w->depth++;
  w->fresh |= (uint64_t)1 << w->depth;
}

static void jw_close(jw *w, char brace) {
  putc_(w, brace);
  w->fresh &= ~((uint64_t)1 << w->depth);
  w->depth--;
}

static void put_u64(jw *w, uint64_t v) {
  char t[20];
  size_t i = sizeof t;
  do {
    t[--i] = (char)('0' + v % 10);
    v /= 10;
  } while (v != 0);
  put(w, t + i, sizeof t - i);
}

static void jw_u64(jw *w, const char *key, uint64_t v) {
  jw_sep(w, key);
  put_u64(w, v);
}

static void jw_i64(jw *w, const char *key, int64_t v) {
  jw_sep(w, key);
  if (v < 0) putc_(w, '-');
  put_u64(w, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v);
}

/* null for NaN and infinities, which JSON has no words for. */
static void jw_num(jw *w, const char *key, double v) {
  jw_sep(w, key);
  if (!isfinite(v)) {
    puts_(w, "null");
    return;
  }
  char t[32];
  int n = snprintf(t, sizeof t, "%.6g", v);
  put(w, t, n > 0 ? (size_t)n : 0);
}

/* v >= 0 with two decimals, without printf (a column of every rank). */
static void jw_fix2(jw *w, const char *key, double v) {
  if (!isfinite(v) || v < 0 || v > 1e15) {
    jw_num(w, key, v);
    return;
  }
  uint64_t h = (uint64_t)(v * 100.0 + 0.5);
  jw_sep(w, key);
  put_u64(w, h / 100);
  char t[3] = {'.', (char)('0' + h % 100 / 10), (char)('0' + h % 10)};
  put(w, t, h % 100 ? (h % 10 ? 3 : 2) : 0);
}

static void jw_str(jw *w, const char *key, const char *v) {
  jw_sep(w, key);
  if (v == NULL)
    puts_(w, "null");
  else
    jw_escaped(w, v, SIZE_MAX);
}

static void jw_bool(jw *w, const char *key, bool v) {
  jw_sep(w, key);
  puts_(w, v ? "true" : "false");
}

static void jw_null(jw *w, const char *key) {
  jw_sep(w, key);
  puts_(w, "null");
}

/* The text into r as a 200 answer; SP_ENOMEM or SP_ETOOBIG instead (the
 * text freed). */
static int jw_finish(jw *w, sp_coord_http_resp *r) {
  char *body;
  size_t len;
  int rc = sp_textbuf_take(&w->b, &body, &len);
  if (rc != 0) return rc;
  r->status = 200;
  r->content_type = k_json;
  r->body = body;
  r->len = len;
  r->body_static = false;
  r->cache_control = NULL;
  return 0;
}

/* ---- errors and arguments ---- */

/* An error answer: {"error": msg, "argument": arg} (arg may be NULL),
 * with the routes there are for a 404. */
static int answer_error(sp_coord_http_resp *r, unsigned status, const char *arg,
                        const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

typedef int route_fn(sp_coord *c, const sp_coord_http_query *q,
                     sp_coord_http_resp *r);
static route_fn route_job, route_ranks, route_history, route_plan,
    route_buffers;

typedef struct route {
  const char *path;
  route_fn *fn;
  const char *args[4]; /* the arguments it takes, NULL-terminated */
} route;

static const route k_routes[] = {
    {"/api/v1/job", route_job, {NULL}},
    {"/api/v1/ranks", route_ranks, {"first", "count", NULL}},
    {"/api/v1/history", route_history, {"since", NULL}},
    {"/api/v1/plan", route_plan, {NULL}},
    {"/api/v1/buffers", route_buffers, {"first", "count", "prefix", NULL}},
};
#define N_ROUTES (sizeof k_routes / sizeof k_routes[0])

static int answer_error(sp_coord_http_resp *r, unsigned status, const char *arg,
                        const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  jw w;
  jw_init(&w, 0);
  jw_open(&w, NULL, '{');
  jw_str(&w, "error", msg);
  if (arg != NULL) { /* the client's, echoed: bounded */
    jw_sep(&w, "argument");
    jw_escaped(&w, arg, 64);
  }
  if (status == 404) {
    jw_open(&w, "paths", '[');
    for (size_t i = 0; i < N_ROUTES; i++) jw_str(&w, NULL, k_routes[i].path);
    jw_close(&w, ']');
  }
  jw_close(&w, '}');
  int rc = jw_finish(&w, r);
  if (rc == 0) r->status = status;
  return rc;
}

/* How many of q's arguments count (the listener keeps at most
 * SP_COORD_HTTP_ARGS). */
static size_t n_args(const sp_coord_http_query *q) {
  if (q == NULL) return 0;
  return q->n < SP_COORD_HTTP_ARGS ? q->n : SP_COORD_HTTP_ARGS;
}

/* Every argument is one the route takes, given once: a misspelt one must
 * not quietly be the default. False after answering 400 (*rc: how that
 * went). */
static bool args_known(const route *rt, const sp_coord_http_query *q,
                       sp_coord_http_resp *r, int *rc) {
  size_t n_known = 0;
  while (n_known < 4 && rt->args[n_known] != NULL) n_known++;
  for (size_t i = 0; i < n_args(q); i++) {
    const char *k = q->key[i] != NULL ? q->key[i] : "";
    bool known = false;
    for (size_t j = 0; j < n_known; j++) known |= strcmp(k, rt->args[j]) == 0;
    if (!known) {
      const char *near = sp_suggest(k, rt->args, n_known);
      char hint[96] = "";
      if (near != NULL)
        snprintf(hint, sizeof hint, " (did you mean \"%s\"?)", near);
      else if (n_known == 0)
        snprintf(hint, sizeof hint, " (it takes none)");
      else
        snprintf(hint, sizeof hint, " (it takes %s%s%s%s%s)", rt->args[0],
                 n_known > 1 ? ", " : "", n_known > 1 ? rt->args[1] : "",
                 n_known > 2 ? ", " : "", n_known > 2 ? rt->args[2] : "");
      *rc = answer_error(r, 400, k, "%s: unknown argument \"%.64s\"%s",
                         rt->path, k, hint);
      return false;
    }
    for (size_t j = 0; j < i; j++)
      if (q->key[j] != NULL && strcmp(q->key[j], k) == 0) {
        *rc = answer_error(r, 400, k, "%s: argument \"%s\" given twice",
                           rt->path, k);
        return false;
      }
  }
  return true;
}

/* A bad argument: which, and why. */
typedef struct arg_err {
  const char *arg;
  char msg[256];
} arg_err;

/* Argument key as a decimal number in [lo, hi] into *out (left alone
 * when it was not given). False with e filled for anything else: a sign,
 * a space, hex, an empty value, more than 20 digits, out of range. */
static bool num_arg(const sp_coord_http_query *q, const char *key, uint64_t lo,
                    uint64_t hi, uint64_t *out, arg_err *e) {
  const char *s = sp_coord_http_arg(q, key);
  if (s == NULL) return true;
  uint64_t v = 0;
  size_t n = 0;
  bool over = false;
  for (; s[n] >= '0' && s[n] <= '9'; n++) {
    unsigned d = (unsigned)(s[n] - '0');
    if (v > (UINT64_MAX - d) / 10) over = true;
    v = over ? v : v * 10 + d;
  }
  e->arg = key;
  if (n == 0 || s[n] != '\0') {
    snprintf(e->msg, sizeof e->msg,
             "%s: \"%.40s\" is not a number (decimal digits, e.g. %s=%" PRIu64
             ")",
             key, s, key, lo);
    return false;
  }
  if (over || v < lo || v > hi) {
    snprintf(e->msg, sizeof e->msg,
             "%s: %.40s is out of range (%" PRIu64 " to %" PRIu64 ")", key, s,
             lo, hi);
    return false;
  }
  *out = v;
  return true;
}

static int bad_arg(sp_coord_http_resp *r, const arg_err *e) {
  return answer_error(r, 400, e->arg, "%s", e->msg);
}

/* ---- names ---- */

static const char *enum_name(const ProtobufCEnumDescriptor *d, int v) {
  const ProtobufCEnumValue *x = protobuf_c_enum_descriptor_get_value(d, v);
  return x ? x->name : "UNKNOWN";
}

static const char *job_state_name(int st) {
  const char *n = enum_name(&shardplane__v1__job_state__descriptor, st);
  return strncmp(n, "JOB_", 4) == 0 ? n + 4 : n;
}

static const char *alert_kind_name(int k) {
  return k == SHARDPLANE__V1__ALERT_KIND__ALERT_LOST
             ? "LOST"
             : enum_name(&shardplane__v1__alert_kind__descriptor, k);
}

static const char *status_name(int s) {
  return enum_name(&shardplane__v1__rank_status__descriptor, s);
}

/* A root state's name; "NONE" for a rank that never reported one. */
static const char *root_name(int st) {
  return sp_state_valid(SP_MACHINE_ROOT, st)
             ? sp_state_name(SP_MACHINE_ROOT, st)
             : "NONE";
}

/* A dtype's name, null for none (unset in the job's mixed precision: the
 * parameters' own; a unit's buffer_dtype: buffers keep theirs). */
static void jw_dtype(jw *w, const char *key, sp_dtype t) {
  jw_str(w, key, t == SP_DTYPE_INVALID ? NULL : sp_dtype_name(t));
}

/* ---- culprits and victims ---- */

#define NAMED_CULPRIT 1u
#define NAMED_VICTIM 2u

/* Marks the ranks in [first, first + n) the open alerts name, as
 * flags[rank - first]; once the job FAILED, its culprit and the ranks lost
 * after it too. A healthy job has none: a fault the job recovered from
 * (its alert closed) names nobody now. */
static void mark_named(sp_coord *c, Shardplane__V1__Alert *const *open,
                       size_t n_open, uint32_t first, uint32_t n,
                       uint8_t *flags) {
  memset(flags, 0, n);
  for (size_t i = 0; i < n_open; i++) {
    const Shardplane__V1__Alert *a = open[i];
    for (size_t k = 0; k < a->n_culprits; k++)
      if (a->culprits[k] >= first && a->culprits[k] - first < n)
        flags[a->culprits[k] - first] |= NAMED_CULPRIT;
    for (size_t k = 0; k < a->n_victims; k++)
      if (a->victims[k] >= first && a->victims[k] - first < n)
        flags[a->victims[k] - first] |= NAMED_VICTIM;
  }
  if (sp_coord_verdict_state(c) != SHARDPLANE__V1__JOB_STATE__JOB_FAILED)
    return;
  uint32_t cul;
  if (sp_coord_verdict_culprit(c, &cul) && cul >= first && cul - first < n)
    flags[cul - first] |= NAMED_CULPRIT;
  for (uint32_t i = 0; i < n; i++)
    if (sp_coord_verdict_victim(c, first + i, NULL)) flags[i] |= NAMED_VICTIM;
}

/* At most SP_COORD_API_MAX_LISTED of v, as numbers. */
static void jw_rank_list(jw *w, const char *key, const uint32_t *v, size_t n) {
  jw_open(w, key, '[');
  for (size_t i = 0; i < n && i < SP_COORD_API_MAX_LISTED; i++)
    jw_u64(w, NULL, v[i]);
  jw_close(w, ']');
}

/* v (ascending) in words, "ranks 0-2, 5"; "" for none; "..." where it
 * was cut. */
static void jw_rank_words(jw *w, const char *key, const uint32_t *v, size_t n) {
  char text[1024] = "";
  if (n > 0) sp_coord_diag_fmt_ranks(v, n, text, sizeof text);
  if (strlen(text) == sizeof text - 1) memcpy(text + sizeof text - 4, "...", 4);
  jw_str(w, key, text);
}

/* "culprits", "n_culprits", "culprits_text" (and the victims'). */
static void jw_ranks_named(jw *w, const char *what, const uint32_t *v,
                           size_t n) {
  char key[32];
  jw_rank_list(w, what, v, n);
  snprintf(key, sizeof key, "n_%s", what);
  jw_u64(w, key, n);
  snprintf(key, sizeof key, "%s_text", what);
  jw_rank_words(w, key, v, n);
}

static void jw_alert(jw *w, const Shardplane__V1__Alert *a, uint64_t now,
                     bool open) {
  jw_open(w, NULL, '{');
  jw_str(w, "kind", alert_kind_name(a->kind));
  jw_str(w, "message", a->message ? a->message : "");
  jw_u64(w, "time_ms", a->time_ms);
  if (open) jw_num(w, "age_s", now > a->time_ms ? (now - a->time_ms) / 1e3 : 0);
  jw_ranks_named(w, "culprits", a->culprits, a->n_culprits);
  jw_ranks_named(w, "victims", a->victims, a->n_victims);
  jw_close(w, '}');
}

/* ---- /api/v1/job ---- */

/* The verdict in words: headline, its lines, the culprits and victims
 * (flags and list: scratch of the world's size). */
static void jw_why(jw *w, sp_coord *c, const sp_coord_why *y, uint8_t *flags,
                   uint32_t *list) {
  uint32_t world = c->plan->world_size;
  jw_open(w, "why", '{');
  jw_bool(w, "healthy", y->healthy);
  jw_str(w, "headline", y->headline);
  jw_open(w, "lines", '[');
  for (const char *s = y->text; *s != '\0';) {
    const char *nl = strchr(s, '\n');
    size_t len = nl ? (size_t)(nl - s) : strlen(s);
    char line[SP_DIAG_MAX + 64];
    snprintf(line, sizeof line, "%.*s", (int)len, s);
    jw_str(w, NULL, line);
    s += len + (nl != NULL);
  }
  jw_close(w, ']');
  mark_named(c, y->open, y->n_open, 0, world, flags);
  size_t n = 0;
  for (uint32_t r = 0; r < world; r++)
    if (flags[r] & NAMED_CULPRIT) list[n++] = r;
  jw_ranks_named(w, "culprits", list, n);
  n = 0;
  for (uint32_t r = 0; r < world; r++)
    if (flags[r] == NAMED_VICTIM) list[n++] = r;
  jw_ranks_named(w, "victims", list, n);
  jw_close(w, '}');
}

static int route_job(sp_coord *c, const sp_coord_http_query *q,
                     sp_coord_http_resp *r) {
  (void)q;
  const sp_plan *pl = c->plan;
  uint32_t world = pl->world_size;
  sp_coord_why *y = malloc(sizeof *y);
  uint8_t *flags = malloc(world);
  uint32_t *list = malloc((size_t)world * sizeof *list);
  if (y == NULL || flags == NULL || list == NULL) {
    free(y);
    free(flags);
    free(list);
    return SP_ENOMEM;
  }
  uint64_t now = sp_coord_base_now_ms(c);
  sp_coord_verdict_why(c, y);
  Shardplane__V1__GetJobResponse jr = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__Progress p;
  sp_coord_verdict_job(c, &jr, &p);
  Shardplane__V1__RankSummary rs = SHARDPLANE__V1__RANK_SUMMARY__INIT;
  uint32_t by_state[SP_STATE_MAX + 1] = {0};
  sp_coord_ranks_summary(c, &rs, by_state, SP_ROOT_SUMMON_FULL_PARAMS + 1);
  uint64_t tokens = 0;
  for (uint32_t i = 0; i < world; i++) {
    if (!sp_coord_ranks_attached(c, i)) continue;
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, i, &v);
    tokens += v.tokens_per_step;
  }
  uint64_t inc;
  uint32_t restarts;
  sp_coord_agents_incarnation(c, &inc, &restarts);

  jw w;
  jw_init(&w, 4096);
  jw_open(&w, NULL, '{');
  jw_str(&w, "model", c->model->name);
  jw_str(&w, "plan_version", pl->version_hex);
  jw_str(&w, "strategy", sp_strategy_name(pl->strategy));
  jw_u64(&w, "world_size", world);
  jw_u64(&w, "shard_group_size", pl->shard_world);
  jw_u64(&w, "incarnation", inc);
  jw_u64(&w, "restarts", restarts);
  jw_str(&w, "state", job_state_name(jr.state));
  jw_str(&w, "verdict", jr.verdict);
  jw_bool(&w, "healthy", y->healthy);
  jw_open(&w, "progress", '{');
  jw_u64(&w, "step", p.step);
  if (p.total_steps)
    jw_u64(&w, "total_steps", p.total_steps);
  else
    jw_null(&w, "total_steps");
  jw_num(&w, "steps_per_s", p.steps_per_s);
  jw_num(&w, "loss", p.has_loss ? p.loss : NAN);
  jw_num(&w, "eta_s", p.eta_s >= 0 ? p.eta_s : NAN);
  jw_close(&w, '}');
  jw_u64(&w, "tokens_per_step", tokens);
  jw_num(&w, "tokens_per_s", p.steps_per_s * (double)tokens);
  jw_open(&w, "ranks", '{');
  jw_u64(&w, "attached", rs.attached);
  jw_u64(&w, "lost", rs.lost);
  jw_u64(&w, "detached", rs.detached);
  jw_u64(&w, "never_attached", rs.never_attached);
  jw_open(&w, "by_root_state", '{');
  for (int s = SP_ROOT_IDLE; s <= SP_ROOT_SUMMON_FULL_PARAMS; s++)
    jw_u64(&w, sp_state_name(SP_MACHINE_ROOT, s), by_state[s]);
  jw_close(&w, '}');
  jw_close(&w, '}');
  jw_u64(&w, "uptime_ms", now);
  jw_u64(&w, "now_unix_ms", sp_clock_unix_ms());
  jw_u64(&w, "quiet_ms", jr.quiet_ms);
  jw_u64(&w, "quiet_limit_ms", jr.quiet_limit_ms);
  jw_u64(&w, "stall_threshold_ms", jr.stall_threshold_ms);
  jw_u64(&w, "loop_pause_max_ms", c->loop_pause_max_ms);
  jw_u64(&w, "loop_pause_total_ms", c->loop_pause_total_ms);
  jw_u64(&w, "alerts_total", sp_coord_alerts_total(c));
  jw_open(&w, "open_alerts", '[');
  for (size_t i = 0; i < y->n_open; i++) jw_alert(&w, y->open[i], now, true);
  jw_close(&w, ']');
  jw_why(&w, c, y, flags, list);
  Shardplane__V1__Alert *recent[SP_COORD_ALERTS_RECENT];
  size_t n_recent = sp_coord_alerts_recent(c, recent, SP_COORD_ALERTS_RECENT);
  jw_open(&w, "recent_alerts", '[');
  for (size_t i = n_recent; i-- > 0;) jw_alert(&w, recent[i], now, false);
  jw_close(&w, ']');
  jw_close(&w, '}');
  free(y);
  free(flags);
  free(list);
  return jw_finish(&w, r);
}

/* ---- /api/v1/ranks ---- */

/* What a page shows of one rank, gathered in one pass over the rank
 * table and written out a column at a time. */
typedef struct rank_row {
  uint64_t step, heard_ago, mem, peak, predicted;
  float straggler;
  int32_t host; /* index into the page's host list; -1: none */
  uint8_t status, state, named;
} rank_row;

/* The hosts of a page, each listed once in order of first sight. */
typedef struct host_list {
  sp_strmap *index;
  const char **name;
  size_t n, cap;
  const char *last; /* the previous rank's host: most share one */
  int32_t last_i;
} host_list;

/* The host's index, -1 for none, -2 out of memory. */
static int32_t host_index(host_list *h, const char *host) {
  if (host == NULL || host[0] == '\0') return -1;
  if (h->last != NULL && strcmp(h->last, host) == 0) return h->last_i;
  int32_t i = sp_strmap_get(h->index, host);
  if (i < 0) {
    if (h->n == h->cap) {
      size_t cap = h->cap ? h->cap * 2 : 64;
      const char **p = realloc(h->name, cap * sizeof *p);
      if (p == NULL) return -2;
      h->name = p;
      h->cap = cap;
    }
    i = (int32_t)h->n;
    if (sp_strmap_put(h->index, host, i) != 0) return -2;
    h->name[h->n++] = host;
  }
  h->last = host;
  h->last_i = i;
  return i;
}

static int route_ranks(sp_coord *c, const sp_coord_http_query *q,
                       sp_coord_http_resp *r) {
  uint32_t world = c->plan->world_size;
  uint64_t first = 0, count = world;
  arg_err e;
  if (!num_arg(q, "first", 0, world, &first, &e) ||
      !num_arg(q, "count", 1, UINT32_MAX, &count, &e))
    return bad_arg(r, &e);
  uint32_t n = (uint32_t)(count < world - first ? count : world - first);
  rank_row *rows = malloc(((size_t)n + 1) * sizeof *rows);
  uint8_t *named = malloc((size_t)n + 1);
  host_list hosts = {.index = sp_strmap_new(64)};
  if (rows == NULL || named == NULL || hosts.index == NULL) {
    free(rows);
    free(named);
    sp_strmap_free(hosts.index);
    return SP_ENOMEM;
  }
  uint64_t now = sp_coord_base_now_ms(c);
  Shardplane__V1__Alert *open[SP_COORD_ALERTS_MAX_OPEN];
  size_t n_open =
      sp_coord_alerts_list_open(c, now, open, SP_COORD_ALERTS_MAX_OPEN);
  mark_named(c, open, n_open, (uint32_t)first, n, named);
  int rc = 0;
  for (uint32_t i = 0; i < n && rc == 0; i++) {
    uint32_t rank = (uint32_t)first + i;
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, rank, &v);
    rank_row *x = &rows[i];
    x->status = (uint8_t)v.status;
    x->state = (uint8_t)(sp_state_valid(SP_MACHINE_ROOT, v.root) ? v.root : 0);
    x->step = v.step;
    x->heard_ago = v.status == SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED
                       ? UINT64_MAX
                       : (now > v.last_heard_ms ? now - v.last_heard_ms : 0);
    x->mem = v.mem_bytes;
    x->peak = v.mem_peak_bytes;
    x->predicted = v.mem_predicted_bytes;
    x->straggler = sp_coord_straggler_score(c, rank);
    x->named = named[i];
    x->host = host_index(&hosts, v.host);
    if (x->host == -2) rc = SP_ENOMEM;
  }
  jw w;
  /* about 50 bytes a rank at a job's usual figures */
  jw_init(&w, rc == 0 ? (size_t)n * 56 + 4096 : 0);
  jw_open(&w, NULL, '{');
  jw_u64(&w, "world_size", world);
  jw_u64(&w, "first", first);
  jw_u64(&w, "count", n);
  if (first + n < world)
    jw_u64(&w, "next", first + n);
  else
    jw_null(&w, "next");
  jw_u64(&w, "now_ms", now);
  jw_open(&w, "status_names", '[');
  for (int s = 0; s <= SHARDPLANE__V1__RANK_STATUS__DETACHED; s++)
    jw_str(&w, NULL, status_name(s));
  jw_close(&w, ']');
  jw_open(&w, "state_names", '[');
  for (int s = 0; s <= SP_ROOT_SUMMON_FULL_PARAMS; s++)
    jw_str(&w, NULL, root_name(s));
  jw_close(&w, ']');
  jw_open(&w, "hosts", '[');
  for (size_t i = 0; i < hosts.n; i++) jw_str(&w, NULL, hosts.name[i]);
  jw_close(&w, ']');
#define COLUMN(key, expr)              \
  do {                                 \
    jw_open(&w, key, '[');             \
    for (uint32_t i = 0; i < n; i++) { \
      const rank_row *x = &rows[i];    \
      expr;                            \
    }                                  \
    jw_close(&w, ']');                 \
  } while (0)
  COLUMN("host", jw_i64(&w, NULL, x->host));
  COLUMN("status", jw_u64(&w, NULL, x->status));
  COLUMN("state", jw_u64(&w, NULL, x->state));
  COLUMN("step", jw_u64(&w, NULL, x->step));
  COLUMN("heard_ms_ago", x->heard_ago == UINT64_MAX
                             ? jw_i64(&w, NULL, -1)
                             : jw_u64(&w, NULL, x->heard_ago));
  COLUMN("straggler", jw_fix2(&w, NULL, x->straggler));
  COLUMN("mem_bytes", jw_u64(&w, NULL, x->mem));
  COLUMN("mem_peak_bytes", jw_u64(&w, NULL, x->peak));
  COLUMN("mem_predicted_bytes", jw_u64(&w, NULL, x->predicted));
  COLUMN("culprit", jw_u64(&w, NULL, (x->named & NAMED_CULPRIT) != 0));
  COLUMN("victim", jw_u64(&w, NULL, (x->named & NAMED_VICTIM) != 0));
#undef COLUMN
  jw_close(&w, '}');
  free(rows);
  free(named);
  free(hosts.name);
  sp_strmap_free(hosts.index);
  if (rc != 0) {
    sp_textbuf_free(&w.b);
    return rc;
  }
  return jw_finish(&w, r);
}

/* ---- /api/v1/history ---- */

static int route_history(sp_coord *c, const sp_coord_http_query *q,
                         sp_coord_http_resp *r) {
  uint64_t since = 0;
  bool has_since = sp_coord_http_arg(q, "since") != NULL;
  arg_err e;
  if (!num_arg(q, "since", 0, UINT64_MAX, &since, &e)) return bad_arg(r, &e);
  size_t total = sp_coord_history_count(c), from = 0;
  /* the samples are in time order */
  if (has_since)
    while (from < total && sp_coord_history_at(c, from)->t_ms <= since) from++;
  size_t n = total - from;
  jw w;
  jw_init(&w, n * 120 + 512);
  jw_open(&w, NULL, '{');
  jw_u64(&w, "now_ms", sp_coord_base_now_ms(c));
  jw_u64(&w, "period_ms", sp_coord_history_period_ms(c));
  jw_u64(&w, "capacity", SP_COORD_HISTORY_CAP);
  jw_u64(&w, "count", n);
#define COLUMN(key, expr)                                           \
  do {                                                              \
    jw_open(&w, key, '[');                                          \
    for (size_t i = from; i < total; i++) {                         \
      const sp_coord_history_sample *s = sp_coord_history_at(c, i); \
      expr;                                                         \
    }                                                               \
    jw_close(&w, ']');                                              \
  } while (0)
  COLUMN("t_ms", jw_u64(&w, NULL, s->t_ms));
  COLUMN("state", jw_str(&w, NULL, job_state_name(s->state)));
  COLUMN("incarnation", jw_u64(&w, NULL, s->incarnation));
  COLUMN("step", jw_u64(&w, NULL, s->step));
  COLUMN("loss", jw_num(&w, NULL, s->loss));
  COLUMN("steps_per_s", jw_num(&w, NULL, s->steps_per_s));
  COLUMN("tokens_per_s", jw_num(&w, NULL, s->tokens_per_s));
  COLUMN("step_p50_ms", jw_num(&w, NULL, s->step_p50_ms));
  COLUMN("step_p99_ms", jw_num(&w, NULL, s->step_p99_ms));
  COLUMN("attached", jw_u64(&w, NULL, s->attached));
  COLUMN("open_alerts", jw_u64(&w, NULL, s->open_alerts));
#undef COLUMN
  jw_close(&w, '}');
  return jw_finish(&w, r);
}

/* ---- /api/v1/plan ---- */

static int route_plan(sp_coord *c, const sp_coord_http_query *q,
                      sp_coord_http_resp *r) {
  (void)q;
  const sp_plan *pl = c->plan;
  const sp_model *m = pl->model;
  const sp_job *j = &c->job;
  int64_t numel = 0, shard_numel = 0;
  for (size_t u = 0; u < pl->n_units; u++) {
    numel += pl->units[u].numel;
    shard_numel += pl->units[u].shard_numel;
  }
  jw w;
  jw_init(&w, pl->n_units * 400 + 1024);
  jw_open(&w, NULL, '{');
  jw_str(&w, "model", m->name);
  jw_str(&w, "plan_version", pl->version_hex);
  jw_str(&w, "strategy", sp_strategy_name(pl->strategy));
  jw_str(&w, "requested_strategy", sp_strategy_name(j->strategy));
  jw_u64(&w, "world_size", pl->world_size);
  jw_u64(&w, "shard_group_size", pl->shard_world);
  jw_u64(&w, "replicas",
         pl->shard_world ? pl->world_size / pl->shard_world : 1);
  jw_bool(&w, "use_orig_params", pl->use_orig_params);
  jw_open(&w, "mixed_precision", '{');
  jw_bool(&w, "enabled", j->mp.enabled);
  jw_dtype(&w, "param_dtype", j->mp.param_dtype);
  jw_dtype(&w, "reduce_dtype", j->mp.reduce_dtype);
  jw_dtype(&w, "buffer_dtype", j->mp.buffer_dtype);
  jw_bool(&w, "keep_low_precision_grads", j->mp.keep_low_precision_grads);
  jw_close(&w, '}');
  jw_u64(&w, "n_units", pl->n_units);
  jw_u64(&w, "n_params", m->n_params);
  jw_u64(&w, "n_buffers", pl->n_buffers);
  jw_i64(&w, "numel", numel);
  jw_i64(&w, "shard_numel", shard_numel);
  jw_open(&w, "units", '[');
  for (uint32_t u = 0; u < pl->n_units; u++) {
    const sp_unit *x = &pl->units[u];
    jw_open(&w, NULL, '{');
    jw_u64(&w, "index", u);
    jw_str(&w, "module", m->modules[x->module].fqn);
    jw_str(&w, "type", m->modules[x->module].type);
    jw_i64(&w, "parent", x->parent);
    jw_u64(&w, "params", x->n_params);
    jw_i64(&w, "numel", x->numel);
    jw_i64(&w, "shard_numel", x->shard_numel);
    jw_dtype(&w, "dtype", x->dtype);
    jw_dtype(&w, "param_dtype", x->param_dtype);
    jw_dtype(&w, "reduce_dtype", x->reduce_dtype);
    jw_dtype(&w, "buffer_dtype", x->buffer_dtype);
    jw_bool(&w, "full_precision", x->full_precision);
    jw_bool(&w, "mixed_precision", x->mixed_precision);
    jw_bool(&w, "requires_grad", x->requires_grad);
    jw_close(&w, '}');
  }
  jw_close(&w, ']');
  jw_close(&w, '}');
  return jw_finish(&w, r);
}

/* ---- /api/v1/buffers ---- */

static int route_buffers(sp_coord *c, const sp_coord_http_query *q,
                         sp_coord_http_resp *r) {
  const sp_plan *pl = c->plan;
  uint64_t first = 0, count = SP_COORD_API_BUFFER_PAGE;
  arg_err e;
  if (!num_arg(q, "first", 0, pl->n_buffers, &first, &e) ||
      !num_arg(q, "count", 1, UINT32_MAX, &count, &e))
    return bad_arg(r, &e);
  const char *prefix = sp_coord_http_arg(q, "prefix");
  if (prefix != NULL && strlen(prefix) > SP_COORD_MAX_NAME)
    return answer_error(r, 400, "prefix", "prefix: %zu bytes, at most %u",
                        strlen(prefix), SP_COORD_MAX_NAME);
  if (count > SP_COORD_API_BUFFER_PAGE) count = SP_COORD_API_BUFFER_PAGE;
  size_t idx[SP_COORD_API_BUFFER_PAGE], n;
  size_t total = sp_coord_plan_buffer_page(pl, prefix, (size_t)first,
                                           (size_t)count, idx, &n);
  jw w;
  jw_init(&w, n * 200 + 512);
  jw_open(&w, NULL, '{');
  jw_u64(&w, "total", total);
  jw_u64(&w, "first", first);
  jw_u64(&w, "count", n);
  if (first + n < total)
    jw_u64(&w, "next", first + n);
  else
    jw_null(&w, "next");
  jw_open(&w, "buffers", '[');
  for (size_t i = 0; i < n; i++) {
    sp_coord_buffer_row b;
    sp_coord_plan_buffer_row(pl, idx[i], &b);
    jw_open(&w, NULL, '{');
    jw_str(&w, "fqn", b.fqn);
    jw_open(&w, "shape", '[');
    for (int d = 0; d < b.spec->ndim; d++) jw_i64(&w, NULL, b.spec->shape[d]);
    jw_close(&w, ']');
    jw_dtype(&w, "original_dtype", b.orig_dtype);
    jw_dtype(&w, "compute_dtype", b.compute_dtype);
    jw_bool(&w, "cast", b.compute_dtype != b.orig_dtype);
    jw_u64(&w, "owner_unit", b.owner_unit);
    jw_str(&w, "owner_module", sp_plan_unit_fqn(pl, b.owner_unit));
    jw_bool(&w, "persistent", b.persistent);
    jw_close(&w, '}');
  }
  jw_close(&w, ']');
  jw_close(&w, '}');
  return jw_finish(&w, r);
}

/* ---- routing ---- */

int sp_coord_api_get(struct sp_coord *c, const char *path,
                     const sp_coord_http_query *q, sp_coord_http_resp *r) {
  memset(r, 0, sizeof *r);
  const route *rt = NULL;
  for (size_t i = 0; i < N_ROUTES && path != NULL; i++)
    if (strcmp(path, k_routes[i].path) == 0) rt = &k_routes[i];
  if (rt == NULL)
    return answer_error(r, 404, NULL, "no such API path: %.200s",
                        path != NULL ? path : "");
  int rc = 0;
  if (!args_known(rt, q, r, &rc)) return rc;
  rc = rt->fn(c, q, r);
  if (rc == SP_ETOOBIG) {
    bool paged = rt->args[0] != NULL && strcmp(rt->args[0], "first") == 0;
    return answer_error(r, paged ? 400 : 500, paged ? "count" : NULL,
                        "%s: the answer would be over %u MiB%s", rt->path,
                        SP_COORD_API_MAX_BODY >> 20,
                        paged ? "; ask for a smaller page (first, count)" : "");
  }
  if (rc != 0) memset(r, 0, sizeof *r);
  return rc;
}
