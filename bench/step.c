/* What reporting costs a training job.
 *
 * 1. Step time of the reference run (shardplane-coordinator plus --nproc
 *    shardplane-worker processes training examples/mlp.json over Gloo) with
 *    reporting on and with --no-report (transitions still checked locally,
 *    nothing queued or sent), alternating the two modes --repeats times so
 *    that drift of a noisy machine hits both alike. Per run: the median of
 *    rank 0's step durations after a warm-up; the figure is the median over
 *    the repeats of (on / off - 1). Goal: under 1 %.
 * 2. Per-event cost on the training thread: sp_session_transition through a
 *    session attached to a real coordinator, timed in batches of events
 *    (flushed, untimed, between batches), against the same transitions
 *    applied to a bare sp_state_tracker (the check any trainer would do
 *    without shardplane) in the same run. Goal: under 100 ns an event.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"
#include "shardplane.h"

extern char **environ;

#ifndef SP_BIN_DIR
#define SP_BIN_DIR "."
#endif
#ifndef SP_EXAMPLES
#define SP_EXAMPLES "examples"
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, size_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef struct bench_opts {
  int nproc;
  int steps;
  int warmup;
  int batch;
  int repeats;
  long events;
  const char *model;
} bench_opts;

/* One job; returns the median step duration of rank 0 after warm-up, or a
 * negative value on failure. */
static double run_job(const bench_opts *o, bool report, const char *tmpdir) {
  char ws[16], steps[16], batch[16], stats[4096];
  snprintf(ws, sizeof ws, "%d", o->nproc);
  snprintf(steps, sizeof steps, "%d", o->steps);
  snprintf(batch, sizeof batch, "%d", o->batch);
  snprintf(stats, sizeof stats, "%s/stats.json", tmpdir);
  char *ca[] = {SP_BIN_DIR "/shardplane-coordinator", "--listen",
                "127.0.0.1:0", "--model", (char *)o->model, "--world-size", ws,
                "--wrap-type", "Linear", "--quiet", NULL};
  sp_proc coord;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&coord, ca, false, false, "listening on 127.0.0.1:%d",
                    &d) < 0) {
    fprintf(stderr, "bench/step: %s\n", d.msg);
    return -1;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
  pid_t w[64];
  int failed = 0;
  for (int r = 0; r < o->nproc; r++) {
    char rs[16];
    snprintf(rs, sizeof rs, "%d", r);
    char *wa[] = {SP_BIN_DIR "/shardplane-worker", "--coordinator", addr,
                  "--rank", rs, "--steps", steps, "--global-batch", batch,
                  "--log-every", "0", "--checkpoint", "none", "--stats", stats,
                  report ? NULL : "--no-report", NULL};
    if (posix_spawn(&w[r], wa[0], NULL, NULL, wa, environ) != 0) {
      w[r] = 0;
      failed = 1;
    }
  }
  for (int r = 0; r < o->nproc; r++) {
    int st;
    if (w[r] > 0 && (waitpid(w[r], &st, 0) != w[r] || !WIFEXITED(st) ||
                     WEXITSTATUS(st) != 0))
      failed = 1;
  }
  sp_proc_stop(&coord, 5000);
  if (failed) {
    fprintf(stderr, "bench/step: a worker failed\n");
    return -1;
  }
  FILE *f = fopen(stats, "r");
  if (!f) return -1;
  double *v = calloc((size_t)o->steps, sizeof *v);
  int n = 0;
  if (fgetc(f) == '[')
    while (n < o->steps && fscanf(f, " %lf ,", &v[n]) == 1) n++;
  fclose(f);
  double med = -1;
  if (n == o->steps && n > o->warmup)
    med = median(v + o->warmup, (size_t)(n - o->warmup));
  free(v);
  return med;
}

/* ---- per-event cost ---- */

/* The transitions of one training step for n_units units, as the runtime
 * issues them: root in, each unit FORWARD/IDLE, each unit in reverse
 * BACKWARD_PRE/BACKWARD_POST/IDLE, root out. */
typedef struct event {
  sp_machine m;
  uint32_t unit;
  int to;
} event;

static size_t step_events(uint32_t n_units, event *ev) {
  size_t k = 0;
  ev[k++] = (event){SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD};
  for (uint32_t u = 0; u < n_units; u++) {
    ev[k++] = (event){SP_MACHINE_HANDLE, u, SP_HANDLE_FORWARD};
    ev[k++] = (event){SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE};
  }
  for (uint32_t u = n_units; u-- > 0;) {
    ev[k++] = (event){SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_PRE};
    ev[k++] = (event){SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_POST};
    ev[k++] = (event){SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE};
  }
  ev[k++] = (event){SP_MACHINE_ROOT, 0, SP_ROOT_IDLE};
  return k;
}

static int event_cost(const bench_opts *o, double *ns_session,
                      double *ns_tracker) {
  char *ca[] = {SP_BIN_DIR "/shardplane-coordinator", "--listen",
                "127.0.0.1:0", "--model", (char *)o->model, "--world-size",
                "1", "--wrap-type", "Linear", "--quiet", NULL};
  sp_proc coord;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&coord, ca, false, false, "listening on 127.0.0.1:%d",
                    &d) < 0) {
    fprintf(stderr, "bench/step: %s\n", d.msg);
    return -1;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
  sp_session_opts so = {.coordinator = addr, .rank = 0,
                        .queue_events = 1 << 16};
  sp_session *s = NULL;
  int rc = sp_session_open(&so, &s, &d);
  if (rc < 0) {
    fprintf(stderr, "bench/step: %s\n", d.msg);
    sp_proc_stop(&coord, 5000);
    return rc;
  }
  uint32_t n_units = (uint32_t)sp_session_plan(s)->n_units;
  event *ev = calloc(2 + 5 * (size_t)n_units, sizeof *ev);
  size_t per_step = step_events(n_units, ev);
  sp_state_tracker tr;
  sp_state_tracker_init(&tr, n_units, NULL);
  /* batches below the queue size, flushed (untimed) in between, so the
   * figure is the append path, never a full queue */
  size_t steps_per_batch = (1 << 14) / per_step;
  double t_sess = 0, t_track = 0;
  long done = 0;
  for (int pass = 0; rc == 0 && done < o->events; pass++) {
    double t0 = now_s();
    for (size_t i = 0; i < steps_per_batch; i++)
      for (size_t k = 0; k < per_step; k++)
        rc |= sp_session_transition(s, ev[k].m, ev[k].unit, ev[k].to, NULL);
    double t1 = now_s();
    for (size_t i = 0; i < steps_per_batch; i++)
      for (size_t k = 0; k < per_step; k++)
        rc |= sp_state_tracker_apply(&tr, ev[k].m, ev[k].unit, ev[k].to, NULL);
    double t2 = now_s();
    t_sess += t1 - t0;
    t_track += t2 - t1;
    done += (long)(steps_per_batch * per_step);
    if (rc == 0) rc = sp_session_flush(s, 10000, &d);
  }
  if (rc < 0) fprintf(stderr, "bench/step: %s\n", d.msg);
  *ns_session = t_sess * 1e9 / (double)done;
  *ns_tracker = t_track * 1e9 / (double)done;
  sp_state_tracker_free(&tr);
  free(ev);
  sp_session_close(s, 5000, NULL);
  sp_proc_stop(&coord, 5000);
  return rc < 0 ? rc : 0;
}

static void usage(FILE *f) {
  fputs("usage: bench/step [--nproc N] [--steps N] [--global-batch N] "
        "[--repeats N] [--events N] [--model PATH]\n"
        "Step time of the reference run with reporting on vs off, and the\n"
        "per-event cost of reporting on the training thread.\n", f);
}

int main(int argc, char **argv) {
  bench_opts o = {.nproc = 2, .steps = 400, .warmup = 20, .batch = 96,
                  .repeats = 5, .events = 20000000,
                  .model = SP_EXAMPLES "/mlp.json"};
  static const struct option opts[] = {
      {"nproc", required_argument, NULL, 'n'},
      {"steps", required_argument, NULL, 's'},
      {"global-batch", required_argument, NULL, 'b'},
      {"repeats", required_argument, NULL, 'r'},
      {"events", required_argument, NULL, 'e'},
      {"model", required_argument, NULL, 'm'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case 'n': o.nproc = atoi(optarg); break;
      case 's': o.steps = atoi(optarg); break;
      case 'b': o.batch = atoi(optarg); break;
      case 'r': o.repeats = atoi(optarg); break;
      case 'e': o.events = atol(optarg); break;
      case 'm': o.model = optarg; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (o.nproc < 1 || o.nproc > 64 || o.steps <= o.warmup || o.batch < 1 ||
      o.batch % o.nproc || o.repeats < 1 || o.events < 1) {
    usage(stderr);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  char tmpl[] = "/tmp/shardplane-bench-step-XXXXXX";
  char *tmp = mkdtemp(tmpl);
  if (!tmp) {
    perror("mkdtemp");
    return 1;
  }
  printf("bench/step: %s, %d ranks, %d steps of %d samples (median after "
         "%d warm-up steps), %d repeats\n", o.model, o.nproc, o.steps,
         o.batch, o.warmup, o.repeats);
  printf("%-8s %14s %14s %10s\n", "repeat", "on ms/step", "off ms/step",
         "on/off-1");
  double *over = calloc((size_t)o.repeats, sizeof *over);
  int ret = 0;
  for (int r = 0; r < o.repeats; r++) {
    /* alternate which mode goes first */
    bool first_on = r % 2 == 0;
    double a = run_job(&o, first_on, tmp), b = run_job(&o, !first_on, tmp);
    double on = first_on ? a : b, off = first_on ? b : a;
    if (on <= 0 || off <= 0) {
      ret = 1;
      break;
    }
    over[r] = on / off - 1;
    printf("%-8d %14.3f %14.3f %+9.2f%%\n", r + 1, on * 1e3, off * 1e3,
           over[r] * 100);
    fflush(stdout);
  }
  double ns_sess = 0, ns_track = 0;
  if (ret == 0) {
    double m = median(over, (size_t)o.repeats);
    printf("reporting overhead on step time (median of %d): %+.2f%%  "
           "(goal: under 1%%) %s\n", o.repeats, m * 100,
           m < 0.01 ? "PASS" : "FAIL");
    if (event_cost(&o, &ns_sess, &ns_track) < 0) ret = 1;
  }
  if (ret == 0)
    printf("per-event cost on the training thread: %.1f ns "
           "(sp_session_transition), baseline %.1f ns (bare state "
           "tracker), ratio %.2f  (goal: under 100 ns) %s\n",
           ns_sess, ns_track, ns_sess / ns_track,
           ns_sess < 100 ? "PASS" : "FAIL");
  free(over);
  char stats[4096];
  snprintf(stats, sizeof stats, "%s/stats.json", tmp);
  unlink(stats);
  rmdir(tmp);
  return ret;
}
