/* One rank's job (worker_run.h): the session, the communicators and the
 * runtime around the trainer of the job's model, the steps, the
 * checkpoints, and the stops a signal or an abort asks for. */
#include "worker_run.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "mlp_train.h"
#include "synthetic_train.h"
#include "train_memory.h"
#include "train_model.h"
#include "worker_stats.h"
#include "worker_test_state.h"

/* SIGINT / SIGTERM: the first asks for a checkpoint and a stop at the
 * next step boundary (every rank learns it there, sp_fsdp_any); a second
 * one ends the process at once. */
static volatile sig_atomic_t g_stop_signal;

static void on_stop_signal(int sig) {
  if (g_stop_signal) {
    signal(sig, SIG_DFL);
    raise(sig); /* delivered when the handler returns */
    return;
  }
  g_stop_signal = sig;
}

void sp_worker_catch_stop_signals(void) {
  struct sigaction sa = {.sa_handler = on_stop_signal, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

/* The communicators, for the session's abort callback, which runs on the
 * session's thread: the lock keeps an abort off a communicator being
 * freed. */
static pthread_mutex_t g_comms_lock = PTHREAD_MUTEX_INITIALIZER;
static sp_comm *g_comms[3];

/* The session calls on_abort once: an ABORT that comes while the
 * communicators are still being opened must stop them too, or this rank
 * trains on and waits in its first collective for peers that stopped. */
static bool g_aborted;

static void on_abort(void *user, const char *reason) {
  const sp_worker_opts *o = user;
  fprintf(stderr, "shardplane-worker: rank %ld: aborting collectives: %s\n",
          o->rank, reason);
  pthread_mutex_lock(&g_comms_lock);
  g_aborted = true;
  for (int i = 0; i < 3; i++)
    if (g_comms[i]) sp_comm_abort(g_comms[i]);
  pthread_mutex_unlock(&g_comms_lock);
}

static void set_comms(sp_comm *world, sp_comm *shard, sp_comm *replica) {
  pthread_mutex_lock(&g_comms_lock);
  g_comms[0] = world;
  g_comms[1] = shard;
  g_comms[2] = replica;
  for (int i = 0; i < 3 && g_aborted; i++)
    if (g_comms[i]) sp_comm_abort(g_comms[i]);
  pthread_mutex_unlock(&g_comms_lock);
}

/* The rank's GPU ("cuda:N"), or -1 on the CPU. */
static int gpu_of(const sp_worker_opts *o) {
  int dev = -1;
  if (o->device && sscanf(o->device, "cuda:%d", &dev) != 1) dev = -1;
  return dev;
}

/* This rank's predicted peak (train_memory.h) against what its host has
 * available, or on a GPU what the device has free: as shardplane run
 * checks every rank it places, for jobs an agent launched. The
 * prediction goes to *pred. */
static int check_memory(const sp_worker_opts *o, const sp_plan *plan,
                        const sp_mlp_train_cfg *cfg, uint32_t rank,
                        sp_train_mem *pred, sp_diag *d) {
  int dev = gpu_of(o);
  char host[32];
  snprintf(host, sizeof host, "rank %u's host", rank);
  return sp_train_mem_check(plan, cfg, &o->train, dev >= 0 ? 0 : 1, host, dev,
                            dev >= 0 ? 1 : 0, pred, d);
}

/* What the rank reports of its memory (sp_session_set_memory), in the
 * terms of its prediction: on the CPU the process's resident bytes (now
 * and at most) against the whole rank's peak; on a GPU what the runtime
 * holds of the device (its pool, cached blocks included) plus the
 * trainer's activations, against the prediction less the process's
 * footprint, which stays on the host. predicted 0: none made. */
typedef struct mem_report {
  bool gpu;
  uint64_t act;       /* the trainer's activations and scratch, bytes */
  uint64_t predicted; /* this rank's predicted peak, as above */
  double at;          /* sp_clock_s of the last report; 0: none yet */
} mem_report;

/* Reads /proc at most once a second: a step of a small model takes
 * less than the two reads. */
static void report_memory(sp_session *s, sp_fsdp *f, mem_report *m) {
  double t = sp_clock_s();
  if (m->at > 0 && t - m->at < 1.0) return;
  m->at = t;
  uint64_t now = 0, peak = 0;
  if (m->gpu) {
    sp_fsdp_stats st;
    sp_fsdp_get_stats(f, &st);
    now = st.mem.reserved.current + m->act;
    peak = st.mem.reserved.peak + m->act;
  } else {
    long long rss = sp_worker_proc_bytes("VmRSS:");
    long long hwm = sp_worker_proc_bytes("VmHWM:");
    now = rss > 0 ? (uint64_t)rss : 0;
    peak = hwm > 0 ? (uint64_t)hwm : 0;
  }
  sp_session_set_memory(s, now, peak, m->predicted);
}

/* Every kind asked for, into --checkpoint-dir/<kind>; each replaces the
 * previous one of its kind only once complete (sp_ckpt_save). */

static int save_checkpoints(const sp_worker_opts *o, sp_fsdp *f, uint32_t rank,
                            uint64_t step, sp_diag *d) {
  for (int k = SP_CKPT_FULL; o->wf.ckpt_dir && k <= SP_CKPT_LOCAL; k++) {
    if (!o->wf.kinds[k]) continue;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", o->wf.ckpt_dir,
             sp_ckpt_kind_dir((sp_ckpt_kind)k));
    int rc = sp_ckpt_save(f, (sp_ckpt_kind)k, dir, d);
    if (rc < 0) return rc;
    if (rank == 0) {
      printf("checkpoint (%s) of step %llu: %s\n",
             sp_ckpt_kind_name((sp_ckpt_kind)k), (unsigned long long)step, dir);
      fflush(stdout);
    }
  }
  return 0;
}

/* Whether the checkpoint this run resumes from lies in the directory it
 * writes to: the run continues that job (with elastic hosts, at another
 * world size, so under another plan), and what the directory holds is
 * its own to replace. */
static bool resumes_own(const sp_worker_opts *o) {
  char from[PATH_MAX], dir[PATH_MAX];
  if (o->wf.load_dir == NULL || realpath(o->load_from, from) == NULL ||
      realpath(o->wf.ckpt_dir, dir) == NULL)
    return false;
  size_t n = strlen(dir);
  return strncmp(from, dir, n) == 0 && from[n] == '/';
}

/* --load, with --load-params-only or the checkpoint's optimizer state and
 * step; a state mismatch names the flag that loads anyway. */
static int load(const sp_worker_opts *o, sp_fsdp *f, sp_ckpt_info *info,
                sp_diag *d) {
  sp_ckpt_load_opts lo = {.params_only = o->wf.load_params_only};
  int rc = sp_ckpt_load_with(f, o->wf.load_kind, o->load_from, &lo, info, d);
  if (rc == SP_ESTATE && !o->wf.load_params_only &&
      strstr(d->msg, "state \"")) {
    sp_diag why = *d; /* the message is formatted into d */
    sp_diag_set(d, rc,
                "%.900s; --load-params-only starts the optimizer "
                "afresh",
                why.msg);
  }
  return rc;
}

int sp_worker_run(sp_worker_opts *o, int *stopped, sp_diag *d) {
  sp_session_opts so = {.coordinator = o->coordinator,
                        .rank = (uint32_t)o->rank,
                        .device = o->device,
                        .call_timeout_ms = o->call_timeout_ms,
                        .coordinator_grace_ms = o->coordinator_grace_ms,
                        .no_report = o->no_report,
                        .flight_events = o->flight_events,
                        .on_abort = on_abort,
                        .user = (void *)o,
                        .tls = !o->cred.insecure,
                        .tls_ca_file = o->cred.tls.ca_file,
                        .tls_cert_file = o->cred.tls.cert_file,
                        .tls_key_file = o->cred.tls.key_file,
                        .tls_server_name = o->cred.tls.server_name,
                        .token = o->cred.has_token ? o->cred.token : NULL};
  sp_session *s = NULL;
  sp_comm *world = NULL, *shard = NULL, *replica = NULL;
  sp_fsdp *f = NULL;
  sp_test_state *ts = NULL;
  sp_train_model tm = {0};
  sp_gpt2_trainer *gtr = NULL;
  double eval_s = 0;     /* time in validation, left out of tokens/s */
  double eval_all_s = 0; /* and in all of the run's validations */
  uint64_t eval_tokens = 0;
  sp_mlp_trainer *mtr = NULL;
  double *losses = NULL, *step_s = NULL;
  sp_gpt2_times *gtimes = NULL;
  int rc = sp_session_open(&so, &s, d);
  if (rc < 0) return rc;
  uint32_t rank = sp_session_rank(s), w = sp_session_world(s);
  sp_inject_start(&o->inject, s, rank);
  /* a launcher started as many processes as it was told: if that is not
   * the job's world size, some ranks will never come (or are too many) */
  if (o->env.world_size > 0 && (uint32_t)o->env.world_size != w)
    rc = sp_diag_set(d, SP_EINVAL,
                     "rank %u: $%s=%ld but the coordinator's job has world "
                     "size %u",
                     rank, o->env.world_size_var, o->env.world_size, w);
  /* every rank checks before the rendezvous, so before any rank writes */
  if (rc == 0 && o->wf.ckpt_dir && o->wf.any_kind && !resumes_own(o))
    rc = sp_ckpt_check_dir(o->wf.ckpt_dir, sp_session_plan(s)->version_hex, d);
  /* what to train, and the job as its trainer takes it, checked as
   * shardplane run checks them before starting the workers; every rank
   * takes an equal share of every micro-batch */
  sp_mlp_train_cfg cfg;
  if (rc == 0)
    rc = sp_train_model_pick(sp_session_model(s), o->synthetic, &tm, d);
  if (rc == 0)
    rc = sp_train_model_check(&tm, sp_session_plan(s), &o->train, o->wf.steps,
                              o->wf.lr, o->wf.lr_given, o->wf.global_batch, w,
                              "the world size", &cfg, d);
  /* the prediction is made once: the check's, or without a check, for the
   * report alone (a synthetic run has no trainer's activations to
   * predict: it reports none) */
  sp_train_mem pred = {0};
  bool have_pred = false;
  if (rc == 0 && (tm.gpt || tm.mlp) && !o->train.no_memory_check) {
    rc = check_memory(o, sp_session_plan(s), &cfg, rank, &pred, d);
    have_pred = rc == 0;
  } else if (rc == 0 && (tm.gpt || tm.mlp)) {
    sp_mem_opts mo;
    sp_train_shape sh;
    sp_diag pd = {{0}};
    sp_train_mem_job(&cfg, &o->train, gpu_of(o) >= 0, &mo, &sh);
    have_pred =
        sp_train_mem_predict(sp_session_plan(s), &mo, &sh, &pred, &pd) == 0;
  }
  mem_report mrep = {.gpu = gpu_of(o) >= 0};
  if (have_pred)
    mrep.predicted = mrep.gpu ? pred.peak - pred.footprint : pred.peak;
  sp_gpt2 *gpt = tm.gpt;
  sp_mlp *mlp = tm.mlp;
  bool is_gpt2 = gpt != NULL, is_mlp = mlp != NULL;
  if (rc == 0)
    rc = sp_fsdp_comms_open(s, o->comm_timeout_ms, &world, &shard, &replica, d);
  set_comms(world, shard, replica);
  sp_fsdp_opts fo = {.session = s,
                     .world = world,
                     .shard_group = shard,
                     .replica_group = replica,
                     .backward_prefetch = true,
                     .init_param = sp_mlp_init_param,
                     .init_buffer = sp_mlp_init_buffer,
                     .device = o->device,
                     .comm_timeout_ms = o->comm_timeout_ms};
  /* no hook at all unless a fault of this rank needs one */
  if (sp_inject_wants_hook(&o->inject)) {
    fo.before_collective = sp_inject_before_collective;
    fo.inject_user = &o->inject;
  }
  sp_worker_mem mem = {.rss_before = sp_worker_proc_bytes("VmRSS:")};
  if (is_gpt2) {
    fo.init_param = sp_gpt2_init_param;
    fo.init_buffer = sp_gpt2_init_buffer;
  }
  if (rc == 0) rc = sp_fsdp_new(&fo, &f, d);
  /* the optimizer (the synthetic cycle runs plain SGD) and any stand-in
   * state registered before a load, which fills them with the step count */
  if (rc == 0 && (is_mlp || is_gpt2)) rc = sp_fsdp_optim_init(f, &cfg.optim, d);
  if (rc == 0 && o->test_state)
    rc = sp_test_state_new(f, sp_session_plan(s), o->test_state, &ts, d);
  /* --steps counts all steps: a resumed run starts after the
   * checkpoint's, with its data and schedule (both by step index) */
  uint32_t first = 0;
  sp_ckpt_info info = {0};
  if (rc == 0 && o->wf.load_dir) rc = load(o, f, &info, d);
  if (rc == 0 && o->wf.load_dir) {
    first = info.optim_steps < o->wf.steps ? (uint32_t)info.optim_steps
                                           : o->wf.steps;
    if (rank == 0 && first < o->wf.steps)
      printf("resuming after step %llu of %u (%s)\n",
             (unsigned long long)info.optim_steps, o->wf.steps, o->load_from);
    else if (rank == 0)
      printf(
          "loaded the checkpoint of step %llu (%s): nothing to train up "
          "to --steps %u\n",
          (unsigned long long)info.optim_steps, o->load_from, o->wf.steps);
    fflush(stdout);
  }
  if (rc == 0 && is_mlp) rc = sp_mlp_trainer_new(mlp, f, s, &cfg, &mtr, d);
  if (rc == 0 && is_gpt2)
    rc = sp_gpt2_trainer_new(gpt, f, s, &cfg, &o->train, tm.data, &gtr, d);
  if (rc == 0 && rank == 0 && is_gpt2) {
    printf(
        "rank 0: GPT-2, %lld layers, d_model %lld, %lld heads, context "
        "%lld; %llu tokens a step; data %s\n",
        (long long)gpt->n_layer, (long long)gpt->C, (long long)gpt->n_head,
        (long long)gpt->ctx,
        (unsigned long long)sp_gpt2_trainer_tokens_per_step(gtr),
        sp_gpt2_trainer_data_source(gtr));
    fflush(stdout);
  }
  if (rc == 0 && rank == 0 && !is_mlp && !is_gpt2)
    printf("rank 0: --synthetic: running the synthetic-gradient cycle\n");
  /* the throughput the coordinator shows: this rank's share of a step,
   * its micro-batch times the micro-batches, in tokens for GPT-2 and
   * samples otherwise (the synthetic cycle's nominal ones, as its
   * samples/s line counts them) */
  if (rc == 0) {
    uint64_t per_step = is_gpt2  ? sp_gpt2_trainer_tokens_per_step(gtr)
                        : is_mlp ? cfg.global_batch
                                 : o->wf.global_batch;
    sp_session_set_throughput(s, per_step / w);
    if (gtr) mrep.act = sp_gpt2_trainer_act_bytes(gtr).total;
    if (mtr) mrep.act = sp_mlp_trainer_act_bytes(mtr).total;
  }
  /* what the spec chose, said as the flags that change it: a run without
   * --optimizer must not train AdamW unannounced */
  if (rc == 0 && rank == 0 && cfg.from_spec[0] != '\0') {
    printf("rank 0: from the training defaults of %s: %s\n",
           sp_session_model(s)->name, cfg.from_spec);
    fflush(stdout);
  }
  uint32_t todo = o->wf.steps - first;
  losses = calloc(todo ? todo : 1, sizeof *losses);
  step_s = calloc(todo ? todo : 1, sizeof *step_s);
  gtimes = calloc(todo ? todo : 1, sizeof *gtimes);
  if ((!losses || !step_s || !gtimes) && rc == 0)
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  /* One numbering of steps everywhere: step indexes 0..steps-1 pick the
   * data; steps are reported (progress lines "step K/N", the session's
   * step, so `shardplane ranks` and watch) numbered from 1: step K is the
   * K-th, and after the last one every report says N. */
  double tlast = sp_clock_s();
  uint32_t logged = first; /* steps up to the last progress line */
  uint32_t step = first;
  uint64_t saved = UINT64_MAX; /* the step of the last checkpoint written */
  bool ran_any = false;
  bool late = false; /* the job was done before this group rejoined */
  for (; rc == 0 && step < o->wf.steps; step++) {
    /* replica groups that continue: the quorum is adopted here, and a
     * group that rejoins (or fell a step behind) takes up the live step */
    if (sp_fsdp_quorum_on(f)) {
      uint64_t next = step;
      int q = sp_fsdp_quorum_boundary(f, &next, d);
      if (q < 0) {
        rc = q;
        break;
      }
      if (q == 1) {
        printf(
            "rank %u: the job's steps were done before this replica "
            "group could rejoin\n",
            rank);
        fflush(stdout);
        late = true;
        break;
      }
      if (next != step) {
        printf(
            "rank %u: replica group %u received the live state of step "
            "%llu (it was at step %u)\n",
            rank, rank / sp_session_plan(s)->shard_world,
            (unsigned long long)next, step);
        fflush(stdout);
        if (!ran_any) first = (uint32_t)next;
        step = (uint32_t)next;
        if (step >= o->wf.steps) break;
      }
    }
    sp_inject_step(&o->inject, step + 1);
    /* every rank asks, so all stop after the same step, whichever got
     * the signal */
    bool stop = false;
    rc = sp_fsdp_any(f, g_stop_signal != 0, &stop, d);
    if (rc < 0 || stop) {
      *stopped = g_stop_signal ? g_stop_signal : -1;
      break;
    }
    if (o->report_toggle && step % o->report_toggle == 0)
      rc = sp_session_set_report(s, (step / o->report_toggle) % 2 == 0, d);
    double ts0 = sp_clock_s();
    double *loss = &losses[step - first];
    if (rc < 0)
      break;
    else if (is_gpt2)
      rc = sp_gpt2_trainer_step(gtr, step, loss, d);
    else if (is_mlp)
      rc = sp_mlp_trainer_step(mtr, step, loss, d);
    else
      rc = sp_synthetic_step(f, s, step, o->wf.lr, d);
    /* the quorum changed during the step: nothing of it was applied, and
     * it runs again after the boundary */
    if (rc == SP_EAGAIN && sp_fsdp_quorum_on(f)) {
      if (rank % sp_session_plan(s)->shard_world == 0) {
        printf("%s; running step %u again\n", d->msg, step + 1);
        fflush(stdout);
      }
      rc = 0;
      step--; /* the loop's increment */
      continue;
    }
    ran_any = true;
    if (rc == 0 && ts) rc = sp_test_state_step(ts, d);
    /* a slowed rank's sleep is part of its step, as slow compute is */
    if (rc == 0) sp_inject_after_step(&o->inject, sp_clock_s() - ts0);
    step_s[step - first] = sp_clock_s() - ts0;
    if (rc == 0 && is_gpt2) gtimes[step - first] = sp_gpt2_trainer_times(gtr);
    if (rc == 0) {
      sp_session_set_progress(s, is_mlp || is_gpt2 ? *loss : NAN, o->wf.steps);
      report_memory(s, f, &mrep);
    }
    /* the held-out loss every --eval-every steps and after the last */
    double val = NAN;
    if (rc == 0 && is_gpt2 && o->train.eval_every &&
        ((step + 1) % o->train.eval_every == 0 || step + 1 == o->wf.steps)) {
      double te = sp_clock_s();
      rc = sp_gpt2_trainer_eval(gtr, &val, d);
      eval_s += sp_clock_s() - te;
      eval_all_s += sp_clock_s() - te;
      eval_tokens += sp_gpt2_trainer_eval_tokens(gtr);
    }
    if (rc == 0 && step == first) {
      sp_fsdp_stats st;
      sp_fsdp_get_stats(f, &st);
      mem.allocs_after_first_step = st.mem.allocs;
    }
    if (rc == 0 && rank == 0 && o->wf.log_every &&
        ((step + 1) % o->wf.log_every == 0 || step + 1 == o->wf.steps)) {
      double t = sp_clock_s();
      double per_s =
          (step + 1 - logged) * (double)o->wf.global_batch / (t - tlast);
      double tok_s = is_gpt2
                         ? (step + 1 - logged) *
                               (double)sp_gpt2_trainer_tokens_per_step(gtr) /
                               (t - tlast - eval_s)
                         : 0;
      tlast = t;
      eval_s = 0;
      logged = step + 1;
      if (is_gpt2) {
        char vs[48] = "";
        if (!isnan(val)) snprintf(vs, sizeof vs, "  val loss %.4f", val);
        printf("step %u/%u  loss %.4f%s  %.0f tokens/s\n", step + 1,
               o->wf.steps, *loss, vs, tok_s);
      } else if (is_mlp)
        printf("step %u/%u  loss %.6f  %.0f samples/s\n", step + 1, o->wf.steps,
               *loss, per_s);
      else
        printf("step %u/%u  %.0f samples/s (synthetic gradients)\n", step + 1,
               o->wf.steps, per_s);
      fflush(stdout);
    }
    if (rc == 0 && o->wf.ckpt_every && (step + 1) % o->wf.ckpt_every == 0 &&
        step + 1 < o->wf.steps) {
      rc = save_checkpoints(o, f, rank, step + 1, d);
      saved = step + 1;
    }
  }
  if (rc == 0 && step == o->wf.steps) sp_fsdp_quorum_finished(f, step);
  uint32_t ran = step - first;
  if (rc == 0 && *stopped && rank == 0) {
    printf("stopping after step %u of %u: %s\n", step, o->wf.steps,
           *stopped > 0 ? strsignal(*stopped) : "another rank was signalled");
    fflush(stdout);
  }
  /* the forward-only rate beside the training's (bench/gpu_check.sh
   * compares them): validation is the model's forward alone */
  if (rc == 0 && rank == 0 && eval_tokens > 0 && eval_all_s > 0) {
    printf("validation: %llu tokens forward only, %.0f tokens/s\n",
           (unsigned long long)eval_tokens, (double)eval_tokens / eval_all_s);
    fflush(stdout);
  }
  if (rc == 0 && rank == 0 && o->losses_path && (is_mlp || is_gpt2) &&
      sp_worker_write_losses(o->losses_path, losses, ran) < 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot write", o->losses_path);
  if (rc == 0) {
    sp_fsdp_stats st;
    sp_fsdp_get_stats(f, &st);
    if (gtr) mem.activations = sp_gpt2_trainer_act_bytes(gtr);
    if (mtr) mem.activations = sp_mlp_trainer_act_bytes(mtr);
    mem.train = (sp_worker_mem_phase){.have = true,
                                      .rss_start = mem.rss_before,
                                      .rss_hwm = sp_worker_proc_bytes("VmHWM:"),
                                      .counted = st.mem};
  }
  /* the final checkpoint; a stop before any step trained here has
   * nothing new to keep (the loaded checkpoint, if any, stays) */
  if (rc == 0 && saved != step && !(*stopped && ran == 0) && !late) {
    /* the checkpoints' own peak, from here (both counters restart at what
     * is held now) */
    sp_fsdp_reset_peak_memory(f);
    mem.ckpt.have = true;
    mem.ckpt.rss_start =
        sp_worker_reset_rss_peak() ? sp_worker_proc_bytes("VmRSS:") : -1;
    rc = save_checkpoints(o, f, rank, step, d);
    sp_fsdp_stats st;
    sp_fsdp_get_stats(f, &st);
    mem.ckpt.counted = st.mem;
    mem.ckpt.rss_hwm =
        mem.ckpt.rss_start < 0 ? -1 : sp_worker_proc_bytes("VmHWM:");
  }
  if (rc == 0 && rank == 0 && o->stats_path &&
      sp_worker_write_stats(o->stats_path, step_s, is_gpt2 ? gtimes : NULL,
                            first, ran, o->report_toggle, o->no_report,
                            &mem) < 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot write", o->stats_path);
  /* a rank failed by another's fault says whose: its own error (a
   * collective cancelled) is only the consequence */
  uint32_t culprit;
  if (rc < 0 && sp_session_culprit(s, &culprit) && culprit != rank) {
    char why[SP_DIAG_MAX];
    sp_session_aborted(s, why, sizeof why);
    sp_diag_set(d, rc, "%s", why);
  }
  sp_mlp_trainer_free(mtr);
  sp_gpt2_trainer_free(gtr);
  sp_train_model_clear(&tm);
  free(losses);
  free(step_s);
  free(gtimes);
  /* the state's storage is the runtime's: it goes first */
  sp_test_state_free(ts);
  sp_fsdp_free(f);
  /* leave together, still abortable, then free */
  sp_comm *comms[3] = {world, shard, replica};
  for (int i = 0; i < 3; i++) {
    sp_diag ld = {{0}};
    int lrc = comms[i] ? sp_comm_leave(comms[i], &ld) : 0;
    if (rc == 0 && lrc < 0) {
      *d = ld;
      rc = lrc;
    }
  }
  set_comms(NULL, NULL, NULL);
  sp_comm_free(replica);
  sp_comm_free(shard);
  sp_comm_free(world);
  sp_diag cd = {{0}};
  int crc = sp_session_close(s, 5000, &cd);
  if (rc == 0 && crc < 0) {
    *d = cd;
    rc = crc;
  }
  return rc;
}
