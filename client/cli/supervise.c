/* The supervision of one host's workers (supervise.h). */
#include "supervise.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/flag.h"
#include "cli.h"
#include "remote.h"
#include "shardplane/v1/coordinator.pb-c.h"

static volatile sig_atomic_t g_signal;
static void on_signal(int sig) { g_signal = sig; }

void sp_supervise_catch_signals(void) {
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

int sp_supervise_stop_grace_parse(const char *flag, const char *value,
                                  double *s, sp_diag *d) {
  if (sp_flag_number(flag, value, 0, s, d) != 0 || *s <= 0 || *s > 86400)
    return sp_flag_fail(d, flag, value, "seconds in (0, 86400]");
  return 0;
}

int sp_supervise_alloc_streams(sp_supervise *s) {
  size_t ns = 2 * (size_t)s->n;
  s->streams = calloc(ns, sizeof *s->streams);
  if (s->streams == NULL) {
    sp_cli_error(s->who, "out of memory");
    return SP_EXIT_FAILURE;
  }
  for (size_t i = 0; i < ns; i++)
    s->streams[i] = (sp_out_stream){.fd = -1,
                                    .rank = (int)(s->first_rank + i / 2),
                                    .to = i % 2 ? stderr : stdout};
  return SP_SUPERVISE_PROCEED;
}

/* ---- the stream to the coordinator (agent_ctl.h) ---- */

static void print_alert(const Shardplane__V1__Alert *a);

/* Elastic nodes: this host's place in the world AGENT_START gives. */
static void place(sp_supervise *s, const Shardplane__V1__AgentDown *d) {
  if (s->max_nodes == 0 || d->world_size == 0) return;
  s->ops->place(s, d->world_size, d->node_rank);
  for (size_t i = 0; s->streams && i < 2 * (size_t)s->n; i++)
    s->streams[i].rank = (int)(s->first_rank + i / 2);
  sp_agent_ctl_set_node(s->ctl, d->node_rank);
}

int sp_supervise_open_session(sp_supervise *s, const char *addr,
                              const sp_rpc_client_opts *opts, const char *shown,
                              uint32_t node_rank, uint64_t timeout_ms) {
  sp_agent_ctl_opts o = {.who = s->who,
                         .target = addr,
                         .coordinator = shown,
                         .client = *opts,
                         .grace_ms = s->grace_ms,
                         .node_rank = node_rank,
                         .nproc = s->n,
                         .max_restarts = s->max_restarts,
                         .min_nodes = s->min_nodes,
                         .max_nodes = s->max_nodes};
  sp_diag d = {{0}};
  if (sp_agent_ctl_open(&o, &s->ctl, &d) != 0) {
    sp_cli_error(s->who, "%s", d.msg);
    return SP_EXIT_UNREACHABLE;
  }
  Shardplane__V1__AgentDown *cmd = NULL;
  int got;
  bool said = false;
  for (;;) {
    got = sp_agent_ctl_next(s->ctl, timeout_ms, 0, false, &cmd, &d);
    /* an elastic host waits for the job's other hosts, or for room */
    if (got == 0 && s->max_nodes > 0) {
      if (!said)
        sp_cli_error(s->who,
                     "waiting for the job to have room for this host "
                     "(--nnodes %u:%u)",
                     s->min_nodes, s->max_nodes);
      said = true;
      continue;
    }
    /* an alert of the job before this host's first command (it waited
     * for room): printed, and the wait goes on */
    if (got <= 0 || cmd->command != SHARDPLANE__V1__AGENT_COMMAND__AGENT_ALERT)
      break;
    if (cmd->alert) print_alert(cmd->alert);
    protobuf_c_message_free_unpacked(&cmd->base, NULL);
    cmd = NULL;
  }
  if (got <= 0) {
    if (got == 0)
      sp_cli_error(s->who,
                   "the coordinator did not answer the %s's "
                   "registration within %llu ms",
                   s->who, (unsigned long long)timeout_ms);
    else
      sp_cli_error(s->who, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  int ec = SP_SUPERVISE_PROCEED;
  s->groups_continue = cmd->groups_continue;
  if (cmd->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_START) {
    s->incarnation = cmd->incarnation;
    place(s, cmd);
  } else if (cmd->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_END &&
             cmd->completed) {
    /* nothing to run, and nothing failed: a finished job is never
     * started again (its record stays as it ended) */
    sp_cli_error(s->who,
                 "the job already %s; nothing to start (a new job "
                 "needs a new coordinator)",
                 cmd->reason);
    ec = SP_EXIT_OK;
  } else {
    sp_cli_error(s->who, "the job %s: %s",
                 cmd->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_END
                     ? "ended"
                     : "is restarting",
                 cmd->reason);
    ec = SP_EXIT_FAILURE;
  }
  protobuf_c_message_free_unpacked(&cmd->base, NULL);
  return ec;
}

void sp_supervise_close_session(sp_supervise *s) {
  if (s->ctl == NULL) return;
  uint32_t n;
  double longest;
  sp_agent_ctl_outages(s->ctl, &n, &longest);
  if (n > 0)
    sp_cli_error(s->who,
                 "rode out %u outage%s of the coordinator (the "
                 "longest %.1f s)",
                 n, n == 1 ? "" : "s", longest);
  sp_agent_ctl_close(s->ctl);
  s->ctl = NULL;
}

static void report_exit(sp_supervise *s, const struct sp_supervise_end *e) {
  Shardplane__V1__WorkerExit w = SHARDPLANE__V1__WORKER_EXIT__INIT;
  w.incarnation = e->incarnation;
  w.rank = s->first_rank + e->local;
  w.exit_code = WIFEXITED(e->status) ? WEXITSTATUS(e->status) : 0;
  w.signal = WIFSIGNALED(e->status) ? WTERMSIG(e->status) : 0;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.worker_exit = &w;
  sp_agent_ctl_send(s->ctl, &up);
}

static void send_stopped(sp_supervise *s) {
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.stopped = true;
  up.incarnation = s->incarnation;
  sp_agent_ctl_send(s->ctl, &up);
}

/* ---- the loop ---- */

void sp_supervise_fail(sp_supervise *s, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* a failure while stopping for a signal is the first too: the others
   * (waiting on the one that failed) get the short grace, not the rest of
   * the signal's */
  bool first = !s->failing && (s->ret == SP_EXIT_OK || s->interrupted);
  if (s->ops->failure)
    s->ops->failure(s, msg, first);
  else
    sp_cli_error(s->who, "%s%s", msg, first ? "; stopping the workers" : "");
  if (!first) return;
  s->failing = true;
  if (s->ret == SP_EXIT_OK) s->ret = SP_EXIT_FAILURE;
  double at = sp_clock_s() + SP_SUPERVISE_GRACE_S;
  if (!s->terminated && (s->term_at < 0 || at < s->term_at)) s->term_at = at;
}

/* The workers' output, drained for up to 1 s once they are all gone. */
static void drain_all(sp_supervise *s) {
  size_t ns = 2 * (size_t)s->n;
  double end = sp_clock_s() + 1.0;
  while (sp_workers_pass_output(s->streams, ns, 20) > 0 && sp_clock_s() < end)
    ;
  sp_workers_close_streams(s->streams, ns);
}

/* An alert the coordinator opened, in a line like the workers' ("12:03:04.567
 * [alert]: STALL: ..."), the moment it comes. */
static void print_alert(const Shardplane__V1__Alert *a) {
  char *line = NULL;
  size_t len = 0;
  FILE *m = open_memstream(&line, &len);
  if (m == NULL) return;
  sp_remote_print_alert(m, a);
  if (fclose(m) == 0) sp_workers_print_line(stderr, "alert", line, len);
  free(line);
}

static void reap(sp_supervise *s);
static double stop_grace(const sp_supervise *s);

/* This host's workers started again (AGENT_START of a new incarnation,
 * AGENT_RESTART of a dropped replica group): what the last start's ended
 * is forgotten; a start that fails ends the host's run. */
static void start_again(sp_supervise *s) {
  s->failed = 0;
  s->n_reported = 0;
  s->restarts_done++;
  if (s->ops->start(s) != SP_SUPERVISE_PROCEED && s->ret == SP_EXIT_OK) {
    s->ret = SP_EXIT_FAILURE;
    s->term_at = sp_clock_s();
  }
}

/* A command from the coordinator. */
static void on_command(sp_supervise *s, const Shardplane__V1__AgentDown *d) {
  s->groups_continue = d->groups_continue;
  switch (d->command) {
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_RESTART:
      if (d->incarnation != s->incarnation || s->stopped || s->done) return;
      /* a worker that already died is reported first: its signal or
       * status is the drop's cause the coordinator keeps, rather than
       * its stream breaking. A process's sockets close before it can be
       * reaped, so the coordinator may have acted on the broken stream
       * first: a dying one is waited for a little. */
      for (double until = sp_clock_s() + SP_SUPERVISE_REAP_WAIT_S;;) {
        uint32_t before = s->failed;
        reap(s);
        if (s->failed > before || sp_clock_s() >= until) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
      }
      sp_cli_error(s->who, "%s; restarting the %u worker%s of this host",
                   d->reason, s->n, s->n == 1 ? "" : "s");
      if (s->live > 0)
        sp_workers_stop(s->pids, s->n, (int)(SP_SUPERVISE_TERM_S * 1000));
      s->live = 0;
      drain_all(s);
      start_again(s);
      return;
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_ALERT:
      /* not those of the workers this host stopped (a rank lost) */
      if (d->alert && !s->terminated) print_alert(d->alert);
      return;
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP: {
      if (s->stopped && d->incarnation == s->incarnation && s->live == 0) {
        /* the answer to registering again, stopped: say so again */
        send_stopped(s);
        return;
      }
      /* no fault: they end their step and checkpoint, as on Ctrl-C */
      double wait_s = d->checkpoint ? stop_grace(s) : SP_SUPERVISE_TERM_S;
      sp_cli_error(
          s->who,
          "incarnation %llu ended (%s); stopping the %u "
          "worker%s of this host for a restart%s",
          (unsigned long long)d->incarnation, d->reason, s->live,
          s->live == 1 ? "" : "s",
          d->checkpoint ? " (after a checkpoint, within --stop-grace)" : "");
      sp_workers_stop(s->pids, s->n, (int)(wait_s * 1000));
      s->live = 0;
      s->stopped = true;
      drain_all(s);
      s->incarnation = d->incarnation;
      send_stopped(s);
      return;
    }
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_START:
      if (d->incarnation <= s->incarnation) return;
      if (s->live > 0) {
        /* the coordinator moved on while this host was away from it,
         * before it could say stop: no worker of the last incarnation may
         * live on beside the next one's */
        sp_cli_error(s->who,
                     "incarnation %llu began while the coordinator "
                     "was away; stopping the %u worker%s of incarnation "
                     "%llu",
                     (unsigned long long)d->incarnation, s->live,
                     s->live == 1 ? "" : "s",
                     (unsigned long long)s->incarnation);
        sp_workers_stop(s->pids, s->n, (int)(SP_SUPERVISE_TERM_S * 1000));
        s->live = 0;
        drain_all(s);
      }
      s->incarnation = d->incarnation;
      s->stopped = false;
      place(s, d);
      sp_cli_error(s->who, "incarnation %llu: starting the workers again",
                   (unsigned long long)s->incarnation);
      start_again(s);
      return;
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_END:
      if (d->completed) { /* its workers finish by themselves */
        s->done = true;
        return;
      }
      /* a failure told here already is not told again */
      if (!s->failing) sp_cli_error(s->who, "the job ended: %s", d->reason);
      if (s->ret == SP_EXIT_OK) s->ret = SP_EXIT_FAILURE;
      if (s->term_at < 0 && !s->terminated) s->term_at = sp_clock_s();
      s->done = true;
      return;
    default: return;
  }
}

/* A worker that ended unasked. With restarts the coordinator decides
 * what follows (it hears of the death); without, the others are stopped
 * here. */
static void judge_end(sp_supervise *s, const struct sp_supervise_end *e) {
  char how[96], who[160];
  sp_workers_describe(e->status, how, sizeof how);
  s->ops->name(s, e->local, who, sizeof who);
  report_exit(s, e);
  if (s->n_reported < SP_WORKERS_MAX) s->reported[s->n_reported++] = *e;
  s->failed++;
  if ((s->max_restarts > 0 || s->groups_continue) && sp_agent_ctl_up(s->ctl)) {
    sp_cli_error(s->who, "%s %s; the coordinator decides on a restart", who,
                 how);
    return;
  }
  sp_supervise_fail(s, "%s %s", who, how);
}

/* A worker ended: judged now, or held while the coordinator is away (it
 * may have given up on the coordinator itself). */
static void on_worker_end(sp_supervise *s, uint32_t i, int st) {
  /* after a signal passed on a worker ends 128 + it, or 143 when it
   * stopped for another rank's */
  bool asked = s->interrupted && WIFEXITED(st) &&
               (WEXITSTATUS(st) == 128 + s->interrupted ||
                WEXITSTATUS(st) == 128 + SIGTERM);
  if ((WIFEXITED(st) && WEXITSTATUS(st) == 0) || s->terminated || asked ||
      s->coord_gone)
    return;
  struct sp_supervise_end e = {
      .local = i, .status = st, .incarnation = s->incarnation};
  if (sp_agent_ctl_away(s->ctl) && s->n_held < SP_WORKERS_MAX) {
    char how[96], who[160];
    sp_workers_describe(st, how, sizeof how);
    s->ops->name(s, i, who, sizeof who);
    sp_cli_error(s->who,
                 "%s %s while the coordinator is away; judged when "
                 "it is back",
                 who, how);
    s->held[s->n_held++] = e;
    return;
  }
  judge_end(s, &e);
}

/* The ends held through an outage, once the coordinator is back (or the
 * stream ended and the host goes on alone): those of an incarnation that
 * has ended since went with it. */
static void judge_held(sp_supervise *s) {
  for (uint32_t k = 0; k < s->n_held; k++)
    if (s->held[k].incarnation == s->incarnation && !s->terminated &&
        !s->coord_gone)
      judge_end(s, &s->held[k]);
  s->n_held = 0;
}

/* The stream ended for good (rc from sp_agent_ctl_next, msg its reason).
 * A coordinator gone past the grace, or lost keeping no state dir, ends
 * the job on this host with SP_EXIT_UNREACHABLE and blames no rank (the
 * workers could not reach it either); one that ended or refused the
 * stream leaves the host supervising alone, without restarts. */
static void on_ctl_end(sp_supervise *s, int rc, const char *msg) {
  if (rc == SP_ENOENT) {
    sp_cli_error(s->who, "%s", msg);
    judge_held(s);
    return;
  }
  bool busy = s->live > 0 || s->n_held > 0 || s->failed > 0 || s->stopped;
  if (!busy || s->ret != SP_EXIT_OK) {
    sp_cli_error(s->who, "%s", msg);
    return;
  }
  char held[64] = "";
  if (s->n_held > 0)
    snprintf(held, sizeof held, " (%u had exited meanwhile)", s->n_held);
  sp_cli_error(s->who, "%s; stopping the %u worker%s of this host%s", msg,
               s->live, s->live == 1 ? "" : "s", held);
  s->n_held = 0;
  s->coord_gone = true;
  s->ret = SP_EXIT_UNREACHABLE;
  if (s->term_at < 0 && !s->terminated) s->term_at = sp_clock_s();
}

/* The coordinator's commands, the stream's end, and once it is back after
 * an outage the deaths reported before it (again) and those held
 * meanwhile. */
static void poll_ctl(sp_supervise *s) {
  if (s->ctl == NULL) return;
  bool was_away = sp_agent_ctl_away(s->ctl);
  for (;;) {
    Shardplane__V1__AgentDown *d = NULL;
    sp_diag dg = {{0}};
    int got = sp_agent_ctl_next(s->ctl, 1, s->incarnation, s->stopped, &d, &dg);
    if (got == 0 || got == SP_ESTATE) break;
    if (got < 0) {
      on_ctl_end(s, got, dg.msg);
      break;
    }
    on_command(s, d);
    protobuf_c_message_free_unpacked(&d->base, NULL);
  }
  if (!sp_agent_ctl_up(s->ctl)) return;
  if (was_away)
    for (uint32_t k = 0; k < s->n_reported; k++)
      report_exit(s, &s->reported[k]);
  if (s->n_held > 0) judge_held(s);
}

/* A PSI file's "some avg10=X" (percent); false where the kernel has no
 * PSI (the file is absent, or reading it is refused). */
static bool read_psi(const char *path, float *avg10) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return false;
  char line[256];
  bool ok = false;
  while (!ok && fgets(line, sizeof line, f) != NULL)
    ok = sscanf(line, "some avg10=%f", avg10) == 1;
  fclose(f);
  return ok;
}

/* The host's pressure as the coordinator weighs it (HostPressure). */
static void read_pressure(Shardplane__V1__HostPressure *p) {
  p->has_psi = read_psi("/proc/pressure/cpu", &p->cpu_some_avg10);
  /* memory and io are there whenever cpu is */
  if (p->has_psi) {
    read_psi("/proc/pressure/memory", &p->memory_some_avg10);
    read_psi("/proc/pressure/io", &p->io_some_avg10);
  }
  FILE *f = fopen("/proc/loadavg", "r");
  if (f != NULL) {
    if (fscanf(f, "%f", &p->loadavg_1m) != 1) p->loadavg_1m = 0;
    fclose(f);
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  p->ncpu = n > 0 ? (uint32_t)n : 0;
}

/* Tells the coordinator which of this host's workers have a process
 * alive, and the host's pressure, once every SP_SUPERVISE_ALIVE_S (after
 * the reap: a worker that ended is not listed). Nothing while the stream
 * is not up; a report lost to an outage is simply the next one. */
static void report_alive(sp_supervise *s) {
  double now = sp_clock_s();
  if (!sp_agent_ctl_up(s->ctl) || now < s->alive_at) return;
  s->alive_at = now + SP_SUPERVISE_ALIVE_S;
  uint32_t ranks[SP_WORKERS_MAX];
  size_t n = 0;
  for (uint32_t i = 0; i < s->n; i++)
    if (s->pids[i] > 0) ranks[n++] = s->first_rank + i;
  Shardplane__V1__HostPressure p = SHARDPLANE__V1__HOST_PRESSURE__INIT;
  read_pressure(&p);
  Shardplane__V1__WorkersAlive w = SHARDPLANE__V1__WORKERS_ALIVE__INIT;
  w.incarnation = s->incarnation;
  w.n_alive_ranks = n;
  w.alive_ranks = ranks;
  w.pressure = &p;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.alive = &w;
  sp_agent_ctl_send(s->ctl, &up);
}

static void reap(sp_supervise *s) {
  int st;
  pid_t pid;
  while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
    bool ours = false;
    for (uint32_t i = 0; i < s->n; i++)
      if (s->pids[i] == pid) {
        s->pids[i] = 0;
        s->live--;
        ours = true;
        on_worker_end(s, i, st);
      }
    if (!ours && s->ops->reaped) s->ops->reaped(s, pid, st);
  }
}

static void signal_workers(const sp_supervise *s, int sig) {
  for (uint32_t i = 0; i < s->n; i++)
    if (s->pids[i] > 0) kill(s->pids[i], sig);
}

static double stop_grace(const sp_supervise *s) {
  return s->stop_grace_s > 0 ? s->stop_grace_s
                             : SP_SUPERVISE_STOP_GRACE_DEFAULT_S;
}

static void on_signal_seen(sp_supervise *s, int sig) {
  if (!s->interrupted && s->ret == SP_EXIT_OK) {
    s->interrupted = sig;
    s->ret = 128 + sig;
    sp_cli_error(s->who,
                 "interrupted (%s); passed on to the %u worker%s%s, "
                 "within %.3g s (--stop-grace; a second signal stops them at "
                 "once)",
                 strsignal(sig), s->live, s->live == 1 ? "" : "s",
                 s->on_signal ? s->on_signal : "", stop_grace(s));
    signal_workers(s, sig);
    /* a rank that cannot reach a step boundary (stalled, or waiting in a
     * collective on one that is) must not hold the stop up until the
     * collective library's own timeout */
    s->term_at = sp_clock_s() + stop_grace(s);
    return;
  }
  /* again, or while stopping after a failure: at once */
  sp_cli_error(s->who, "interrupted (%s); stopping the %u worker%s now",
               strsignal(sig), s->live, s->live == 1 ? "" : "s");
  if (s->ret == SP_EXIT_OK || s->interrupted) s->ret = 128 + sig;
  s->terminated = true;
  s->term_at = -1;
  s->kill_at = sp_clock_s();
}

/* The grace after a signal ended: the workers still running are named,
 * once, and stopped without a checkpoint. */
static void note_overdue(sp_supervise *s) {
  char list[sizeof s->overdue] = "";
  size_t used = 0;
  uint32_t k = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    if (s->pids[i] <= 0) continue;
    k++;
    int w = snprintf(list + used, sizeof list - used, "%s%u", used ? ", " : "",
                     s->first_rank + i);
    if (w < 0 || (size_t)w >= sizeof list - used) break;
    used += (size_t)w;
  }
  snprintf(s->overdue, sizeof s->overdue, "rank%s %s", k == 1 ? "" : "s", list);
  sp_cli_error(s->who,
               "%s %s not reached a step boundary within the %.3g s "
               "of --stop-grace; stopping %s",
               s->overdue, k == 1 ? "has" : "have", stop_grace(s),
               k == 1 ? "it" : "them");
}

/* After a signal, once the grace is over: whether the coordinator sees the
 * job still moving (no rank silent for longer than it is while it moves),
 * so that ranks in a long step reach its boundary and checkpoint. A job
 * not yet RUNNING (ranks in the rendezvous), a stuck one, or a
 * coordinator that cannot be asked is not moving. */
static bool still_moving(sp_supervise *s) {
  Shardplane__V1__GetJobResponse *j = NULL;
  if (sp_agent_ctl_get_job(s->ctl, 500, &j) != 0) return false;
  bool moving = j->state == SHARDPLANE__V1__JOB_STATE__JOB_RUNNING &&
                j->quiet_ms <= j->quiet_limit_ms;
  if (moving && !s->extended) {
    s->extended = true;
    sp_cli_error(s->who,
                 "the ranks are still moving (the quietest was "
                 "heard from %.1f s ago, within the %.1f s it can be silent "
                 "while it moves): waiting past --stop-grace for their step "
                 "boundary",
                 (double)j->quiet_ms / 1e3, (double)j->quiet_limit_ms / 1e3);
  }
  protobuf_c_message_free_unpacked(&j->base, NULL);
  return moving;
}

/* SIGTERM to the workers left when due, SIGKILL SP_SUPERVISE_TERM_S
 * after it. */
static void stop_when_due(sp_supervise *s) {
  double now = sp_clock_s();
  int sig = 0;
  if (s->term_at >= 0 && now >= s->term_at) {
    bool told = s->interrupted && !s->failing && s->live > 0;
    if (told && still_moving(s)) {
      s->term_at = sp_clock_s() + 1.0; /* asked again then */
      return;
    }
    if (told) note_overdue(s);
    sig = SIGTERM;
    s->term_at = -1;
    s->kill_at = now + SP_SUPERVISE_TERM_S;
    s->terminated = true;
  } else if (s->kill_at >= 0 && now >= s->kill_at) {
    sig = SIGKILL;
    s->kill_at = -1;
  }
  if (sig) signal_workers(s, sig);
}

int sp_supervise_run(sp_supervise *s) {
  s->ret = SP_EXIT_OK;
  s->term_at = s->kill_at = -1;
  double drained_by = -1; /* every worker gone: the pipes' last words */
  size_t ns = 2 * (size_t)s->n;
  for (;;) {
    size_t open = sp_workers_pass_output(s->streams, ns, 20);
    /* the stream before the ends: when the coordinator goes, this host's
     * stream ends as its workers' do, and their exits (which follow) are
     * then seen as of a coordinator away or gone */
    poll_ctl(s);
    reap(s);
    report_alive(s);
    if (s->ops->tick) s->ops->tick(s);
    int sig = g_signal;
    g_signal = 0;
    if (sig) on_signal_seen(s, sig);
    /* with restarts (or replica groups that continue), workers that
     * failed leave the host waiting for the coordinator's word; without
     * (or once it ended the job) it is done when they are all gone. Ends
     * held through an outage wait for the coordinator too. */
    bool away = sp_agent_ctl_away(s->ctl);
    bool listening = sp_agent_ctl_up(s->ctl) || away;
    bool waiting = !s->done && !s->interrupted && s->ret == SP_EXIT_OK &&
                   s->live == 0 &&
                   (((s->max_restarts > 0 || s->groups_continue) && listening &&
                     (s->failed > 0 || s->stopped)) ||
                    (s->max_nodes > 0 && listening && s->stopped) ||
                    (away && s->n_held > 0));
    if (s->live == 0 && !waiting) {
      if (drained_by < 0) drained_by = sp_clock_s() + 1.0;
      /* counted again: workers started by a command of this turn (and
       * reaped already) have pipes the count above did not see */
      open = sp_workers_pass_output(s->streams, ns, 0);
      if (open == 0 || sp_clock_s() > drained_by) break;
      continue;
    }
    stop_when_due(s);
  }
  sp_workers_close_streams(s->streams, ns);
  return s->ret;
}

void sp_supervise_stop(sp_supervise *s) {
  sp_workers_stop(s->pids, s->n, (int)(SP_SUPERVISE_TERM_S * 1000));
  s->live = 0;
}

/* ---- what a restart loads ---- */

static bool same_folder(const sp_supervise_ckpt_seen *seen, int k,
                        const struct stat *sb) {
  return seen->present[k] && seen->dev[k] == sb->st_dev &&
         seen->ino[k] == sb->st_ino &&
         seen->mtime[k].tv_sec == sb->st_mtim.tv_sec &&
         seen->mtime[k].tv_nsec == sb->st_mtim.tv_nsec;
}

void sp_supervise_ckpt_note(const char *dir, sp_supervise_ckpt_seen *seen) {
  memset(seen, 0, sizeof *seen);
  sp_ckpt_found f;
  if (dir == NULL || sp_ckpt_find(dir, &f) == 0) return;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    struct stat sb;
    if (!f.present[k] || stat(f.dir[k], &sb) != 0) continue;
    seen->present[k] = true;
    seen->dev[k] = sb.st_dev;
    seen->ino[k] = sb.st_ino;
    seen->mtime[k] = sb.st_mtim;
  }
}

bool sp_supervise_ckpt_new(const sp_supervise_ckpt_seen *seen,
                           const sp_ckpt_found *f, sp_ckpt_kind k) {
  /* a checkpoint is published by renaming a new folder over the old one:
   * one that is still the folder noted at the start is an earlier job's */
  struct stat sb;
  return f->present[k] && stat(f->dir[k], &sb) == 0 &&
         !same_folder(seen, k, &sb);
}

bool sp_supervise_restart_ckpt(const sp_supervise *s, const char *dir,
                               const sp_supervise_ckpt_seen *seen,
                               const char *first_load, char *out, size_t cap,
                               sp_ckpt_kind *kind) {
  unsigned long long inc = (unsigned long long)s->incarnation;
  sp_ckpt_found f;
  sp_ckpt_find(dir, &f);
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (!sp_supervise_ckpt_new(seen, &f, (sp_ckpt_kind)k)) continue;
    if (k == SP_CKPT_LOCAL && s->world_changed) {
      sp_cli_error(s->who,
                   "incarnation %llu cannot load %s: a LOCAL checkpoint "
                   "holds the ranks of another world (write SHARDED or FULL "
                   "ones for elastic hosts)",
                   inc, f.dir[k]);
      continue;
    }
    if (snprintf(out, cap, "%s", f.dir[k]) >= (int)cap) continue;
    *kind = (sp_ckpt_kind)k;
    sp_cli_error(s->who, "incarnation %llu loads %s (%s, after step %llu)", inc,
                 out, sp_ckpt_kind_name(*kind), (unsigned long long)f.steps[k]);
    return true;
  }
  if (first_load)
    sp_cli_error(s->who,
                 "incarnation %llu starts from %s, as incarnation 0 "
                 "did: no checkpoint written in %s since the job began",
                 inc, first_load, dir);
  else
    sp_cli_error(s->who,
                 "incarnation %llu starts afresh from step 0: no "
                 "checkpoint written in %s since the job began",
                 inc, dir);
  return false;
}
