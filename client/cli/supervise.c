/* The supervision of one host's workers (supervise.h). */
#include "supervise.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "cli.h"
#include "shardplane/v1/coordinator.pb-c.h"

static volatile sig_atomic_t g_signal;
static void on_signal(int sig) { g_signal = sig; }

void sp_sup_catch_signals(void) {
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

int sp_sup_alloc_streams(sp_sup *s) {
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
  return SP_SUP_PROCEED;
}

/* ---- the stream to the coordinator ---- */

#define AGENT_PATH "/shardplane.v1.Coordinator/AgentSession"

static int ctl_send(sp_sup *s, const Shardplane__V1__AgentUp *up) {
  if (s->ctl_st == NULL) return SP_ESTATE;
  return sp_rpc_sync_stream_send(s->ctl_st, &up->base);
}

/* Waits up to wait_ms for a command. Returns 1 with *out set (the caller
 * frees it), 0 when none came, -1 when the stream ended (said why). */
static int ctl_recv(sp_sup *s, uint64_t wait_ms,
                    Shardplane__V1__AgentDown **out) {
  if (s->ctl_st == NULL) return -1;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_stream_recv(s->ctl_st,
                                   &shardplane__v1__agent_down__descriptor,
                                   wait_ms, &m, &st);
  if (rc == 0) {
    *out = (Shardplane__V1__AgentDown *)m;
    return 1;
  }
  if (rc == SP_ETIMEDOUT) return 0;
  sp_cli_error(s->who, "the coordinator ended the %s's stream: %s%s%s",
               s->who,
               rc == SP_ENOENT ? sp_rpc_code_name(st.code) : sp_strerror(rc),
               rc == SP_ENOENT && st.message[0] ? ": " : "",
               rc == SP_ENOENT ? st.message : "");
  sp_rpc_sync_stream_close(s->ctl_st);
  s->ctl_st = NULL;
  return -1;
}

int sp_sup_open_session(sp_sup *s, const char *addr,
                        const sp_rpc_client_opts *opts, const char *shown,
                        uint32_t node_rank, uint64_t timeout_ms) {
  int rc = sp_rpc_sync_open_opts(addr, opts, &s->ctl);
  if (rc == 0)
    rc = sp_rpc_sync_stream_open(s->ctl, AGENT_PATH, 0, NULL, 0, &s->ctl_st);
  char host[256];
  if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
  host[sizeof host - 1] = '\0';
  Shardplane__V1__AgentRegister reg = SHARDPLANE__V1__AGENT_REGISTER__INIT;
  reg.node_rank = node_rank;
  reg.nproc = s->n;
  reg.max_restarts = s->max_restarts;
  reg.host = host;
  reg.pid = (uint32_t)getpid();
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.register_ = &reg;
  if (rc == 0) rc = ctl_send(s, &up);
  if (rc != 0) {
    sp_cli_error(s->who, "cannot open the %s's stream to %s: %s", s->who,
                 shown, sp_strerror(rc));
    return SP_EXIT_UNREACHABLE;
  }
  Shardplane__V1__AgentDown *d = NULL;
  int got = ctl_recv(s, timeout_ms, &d);
  if (got <= 0) {
    if (got == 0)
      sp_cli_error(s->who, "the coordinator did not answer the %s's "
                   "registration within %llu ms", s->who,
                   (unsigned long long)timeout_ms);
    return SP_EXIT_FAILURE;
  }
  int ec = SP_SUP_PROCEED;
  if (d->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_START) {
    s->incarnation = d->incarnation;
  } else {
    sp_cli_error(s->who, "the job %s: %s",
                 d->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_END
                     ? "ended"
                     : "is restarting",
                 d->reason);
    ec = SP_EXIT_FAILURE;
  }
  protobuf_c_message_free_unpacked(&d->base, NULL);
  return ec;
}

void sp_sup_close_session(sp_sup *s) {
  if (s->ctl_st) {
    sp_rpc_sync_stream_close_send(s->ctl_st);
    sp_rpc_sync_stream_close(s->ctl_st);
  }
  s->ctl_st = NULL;
  if (s->ctl) sp_rpc_sync_close(s->ctl);
  s->ctl = NULL;
}

static void report_exit(sp_sup *s, uint32_t i, int st) {
  Shardplane__V1__WorkerExit w = SHARDPLANE__V1__WORKER_EXIT__INIT;
  w.incarnation = s->incarnation;
  w.rank = s->first_rank + i;
  w.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 0;
  w.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.worker_exit = &w;
  ctl_send(s, &up);
}

/* ---- the loop ---- */

void sp_sup_fail(sp_sup *s, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  bool first = s->ret == SP_EXIT_OK;
  if (s->ops->failure)
    s->ops->failure(s, msg, first);
  else
    sp_cli_error(s->who, "%s%s", msg, first ? "; stopping the workers" : "");
  if (first) {
    s->ret = SP_EXIT_FAILURE;
    s->term_at = sp_clock_s() + SP_SUP_GRACE_S;
  }
}

/* The workers' output, drained for up to 1 s once they are all gone. */
static void drain_all(sp_sup *s) {
  size_t ns = 2 * (size_t)s->n;
  double end = sp_clock_s() + 1.0;
  while (sp_workers_pass_output(s->streams, ns, 20) > 0 && sp_clock_s() < end)
    ;
  sp_workers_close_streams(s->streams, ns);
}

/* A command from the coordinator. */
static void on_command(sp_sup *s, const Shardplane__V1__AgentDown *d) {
  switch (d->command) {
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP: {
      sp_cli_error(s->who, "incarnation %llu ended (%s); stopping the %u "
                   "worker%s of this host for a restart",
                   (unsigned long long)d->incarnation, d->reason, s->live,
                   s->live == 1 ? "" : "s");
      sp_workers_stop(s->pids, s->n, (int)(SP_SUP_TERM_S * 1000));
      s->live = 0;
      s->stopped = true;
      drain_all(s);
      Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
      up.stopped = true;
      up.incarnation = d->incarnation;
      ctl_send(s, &up);
      return;
    }
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_START:
      if (d->incarnation <= s->incarnation) return;
      s->incarnation = d->incarnation;
      s->failed = 0;
      s->stopped = false;
      sp_cli_error(s->who, "incarnation %llu: starting the workers again",
                   (unsigned long long)s->incarnation);
      if (s->ops->start(s) != SP_SUP_PROCEED && s->ret == SP_EXIT_OK) {
        s->ret = SP_EXIT_FAILURE;
        s->term_at = sp_clock_s();
      }
      return;
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_END:
      sp_cli_error(s->who, "the job ended: %s", d->reason);
      if (s->ret == SP_EXIT_OK) s->ret = SP_EXIT_FAILURE;
      if (s->term_at < 0 && !s->terminated) s->term_at = sp_clock_s();
      s->done = true;
      return;
    default: return;
  }
}

/* A worker ended. With restarts the coordinator decides what follows (it
 * hears of the death); without, the others are stopped here. */
static void on_worker_end(sp_sup *s, uint32_t i, int st) {
  /* after a signal passed on a worker ends 128 + it, or 143 when it
   * stopped for another rank's */
  bool asked = s->interrupted && WIFEXITED(st) &&
               (WEXITSTATUS(st) == 128 + s->interrupted ||
                WEXITSTATUS(st) == 128 + SIGTERM);
  if ((WIFEXITED(st) && WEXITSTATUS(st) == 0) || s->terminated || asked)
    return;
  char how[96], who[160];
  sp_workers_describe(st, how, sizeof how);
  s->ops->name(s, i, who, sizeof who);
  report_exit(s, i, st);
  s->failed++;
  if (s->max_restarts > 0 && s->ctl_st != NULL) {
    sp_cli_error(s->who, "%s %s; the coordinator decides on a restart", who,
                 how);
    return;
  }
  sp_sup_fail(s, "%s %s", who, how);
}

static void reap(sp_sup *s) {
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

static void signal_workers(const sp_sup *s, int sig) {
  for (uint32_t i = 0; i < s->n; i++)
    if (s->pids[i] > 0) kill(s->pids[i], sig);
}

static void on_signal_seen(sp_sup *s, int sig) {
  if (!s->interrupted && s->ret == SP_EXIT_OK) {
    s->interrupted = sig;
    s->ret = 128 + sig;
    sp_cli_error(s->who, "interrupted (%s); passed on to the %u worker%s%s "
                 "(a second signal stops them at once)", strsignal(sig),
                 s->live, s->live == 1 ? "" : "s",
                 s->on_signal ? s->on_signal : "");
    signal_workers(s, sig);
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

/* SIGTERM to the workers left when due, SIGKILL SP_SUP_TERM_S after it. */
static void stop_when_due(sp_sup *s) {
  double now = sp_clock_s();
  int sig = 0;
  if (s->term_at >= 0 && now >= s->term_at) {
    sig = SIGTERM;
    s->term_at = -1;
    s->kill_at = now + SP_SUP_TERM_S;
    s->terminated = true;
  } else if (s->kill_at >= 0 && now >= s->kill_at) {
    sig = SIGKILL;
    s->kill_at = -1;
  }
  if (sig) signal_workers(s, sig);
}

int sp_sup_run(sp_sup *s) {
  s->ret = SP_EXIT_OK;
  s->term_at = s->kill_at = -1;
  double drained_by = -1; /* every worker gone: the pipes' last words */
  size_t ns = 2 * (size_t)s->n;
  for (;;) {
    size_t open = sp_workers_pass_output(s->streams, ns, 20);
    reap(s);
    if (s->ops->tick) s->ops->tick(s);
    Shardplane__V1__AgentDown *d = NULL;
    while (s->ctl_st != NULL && ctl_recv(s, 1, &d) == 1) {
      on_command(s, d);
      protobuf_c_message_free_unpacked(&d->base, NULL);
      d = NULL;
    }
    int sig = g_signal;
    g_signal = 0;
    if (sig) on_signal_seen(s, sig);
    /* with restarts, workers that failed leave the host waiting for the
     * coordinator's word; without (or once it ended the job) it is done
     * when they are all gone */
    bool waiting = s->max_restarts > 0 && s->ctl_st != NULL && !s->done &&
                   !s->interrupted && s->ret == SP_EXIT_OK && s->live == 0 &&
                   (s->failed > 0 || s->stopped);
    if (s->live == 0 && !waiting) {
      if (drained_by < 0) drained_by = sp_clock_s() + 1.0;
      if (open == 0 || sp_clock_s() > drained_by) break;
      continue;
    }
    stop_when_due(s);
  }
  sp_workers_close_streams(s->streams, ns);
  return s->ret;
}

void sp_sup_stop(sp_sup *s) {
  sp_workers_stop(s->pids, s->n, (int)(SP_SUP_TERM_S * 1000));
  s->live = 0;
}

/* ---- what a restart loads ---- */

static bool same_folder(const sp_sup_ckpt_seen *seen, int k,
                        const struct stat *sb) {
  return seen->present[k] && seen->dev[k] == sb->st_dev &&
         seen->ino[k] == sb->st_ino &&
         seen->mtime[k].tv_sec == sb->st_mtim.tv_sec &&
         seen->mtime[k].tv_nsec == sb->st_mtim.tv_nsec;
}

void sp_sup_ckpt_note(const char *dir, sp_sup_ckpt_seen *seen) {
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

bool sp_sup_restart_ckpt(const sp_sup *s, const char *dir,
                         const sp_sup_ckpt_seen *seen, const char *first_load,
                         char *out, size_t cap, sp_ckpt_kind *kind) {
  unsigned long long inc = (unsigned long long)s->incarnation;
  sp_ckpt_found f;
  sp_ckpt_find(dir, &f);
  /* a checkpoint is published by renaming a new folder over the old one:
   * one that is still the folder noted at the start is an earlier job's */
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    struct stat sb;
    if (!f.present[k] || stat(f.dir[k], &sb) != 0 ||
        same_folder(seen, k, &sb))
      continue;
    if (snprintf(out, cap, "%s", f.dir[k]) >= (int)cap) continue;
    *kind = (sp_ckpt_kind)k;
    sp_cli_error(s->who, "incarnation %llu loads %s (%s, after step %llu)",
                 inc, out, sp_ckpt_kind_name(*kind),
                 (unsigned long long)f.steps[k]);
    return true;
  }
  if (first_load)
    sp_cli_error(s->who, "incarnation %llu starts from %s, as incarnation 0 "
                 "did: no checkpoint written in %s since the job began",
                 inc, first_load, dir);
  else
    sp_cli_error(s->who, "incarnation %llu starts afresh from step 0: no "
                 "checkpoint written in %s since the job began", inc, dir);
  return false;
}
