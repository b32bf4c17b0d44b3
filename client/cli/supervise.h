/* The supervision of one host's workers, one loop for `shardplane agent`
 * and `shardplane run`:
 *   - their output is passed on (workers.h) until every one has ended;
 *   - a worker that fails or dies is named with its rank and the signal or
 *     status; the others get SP_SUPERVISE_GRACE_S to stop by themselves (the
 *     coordinator aborts them once it notices the lost rank) and say why,
 *     then SIGTERM, and SIGKILL SP_SUPERVISE_TERM_S after it;
 *   - SIGINT or SIGTERM is passed on to every worker, which checkpoint at
 *     the next step boundary and stop; those still running stop_grace_s
 *     later (a stalled rank, or the ranks waiting on it, reach no
 *     boundary) are stopped then, unless the coordinator sees every rank
 *     still moving (a long step: they get more time); a second signal
 *     stops them at once;
 *   - with restarts (max_restarts > 0 and the session to the coordinator
 *     open), a worker's death is reported over AgentSession and the
 *     coordinator decides what follows: AGENT_STOP (this host's workers
 *     stop, and it says so), AGENT_START of the next incarnation (they
 *     start again, loading the last checkpoint) or AGENT_END (the job
 *     ends, naming the rank);
 *   - with replica groups that continue (the coordinator's
 *     --on-group-failure continue) a death is the coordinator's to judge
 *     too, and AGENT_RESTART stops this host's workers (their replica
 *     group was dropped) and starts them again in the same incarnation:
 *     they rejoin with the live state of the groups that trained on;
 *   - about every second (SP_SUPERVISE_ALIVE_S) the coordinator is told
 *     which workers have a process alive (started, not yet reaped) and
 *     the host's pressure (PSI, load average): a rank silent under
 *     pressure while its process lives is waited for (the coordinator's
 *     --loss-grace-ms), one whose process is gone is lost at once;
 *   - the stream outlives the coordinator's outages of up to grace_ms
 *     (agent_ctl.h): a worker that ends while the coordinator is away is
 *     judged once it is back, never blamed for an outage it could not
 *     ride out either; past the grace the workers are stopped and the
 *     exit code is SP_EXIT_UNREACHABLE.
 * The command fills the sp_supervise and its hooks; the loop calls them.
 *
 * Threads: one thread (the command's main thread) uses all of it; the
 * signal handler only sets a flag. */
#ifndef SP_CLI_SUPERVISE_H
#define SP_CLI_SUPERVISE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "agent_ctl.h"
#include "lib/shardplane.h"
#include "rpc/rpc.h"
#include "workers.h"

/* What a setup step returns when the command goes on (an exit code
 * otherwise, >= 0); the same as remote.h's PROCEED. */
#define SP_SUPERVISE_PROCEED (-1)

/* After a failure the other workers get this long to stop by themselves
 * and say why; then SIGTERM, and SIGKILL SP_SUPERVISE_TERM_S after it. */
#define SP_SUPERVISE_GRACE_S 0.5
/* AGENT_RESTART: how long a worker that is dying (its stream broke, which
 * made the coordinator drop its group) is waited for, to be reported with
 * its signal before the others are stopped. */
#define SP_SUPERVISE_REAP_WAIT_S 0.3
#define SP_SUPERVISE_TERM_S 3.0
/* After SIGINT or SIGTERM, how long the workers have to reach a step
 * boundary, checkpoint and stop (--stop-grace); past it they get more
 * time only while the coordinator sees every rank moving (GetJob's
 * quiet_ms within quiet_limit_ms: a long step), never when one is stuck. */
#define SP_SUPERVISE_STOP_GRACE_DEFAULT_S 10.0

typedef struct sp_supervise sp_supervise;

typedef struct sp_supervise_ops {
  /* Starts every local worker of s->incarnation: s->pids[i] and s->live
   * (pids of the ones started even on failure). SP_SUPERVISE_PROCEED, or
   * an exit code with the message printed. Required. */
  int (*start)(sp_supervise *s);
  /* A local worker as messages name it ("rank 3 (local rank 1 on node
   * 1)"). Required. */
  void (*name)(const sp_supervise *s, uint32_t i, char *out, size_t cap);
  /* Tells of a failure that stops the job (first: the first one). NULL:
   * "shardplane WHO: MSG; stopping the workers" (later ones without the
   * tail). */
  void (*failure)(sp_supervise *s, const char *msg, bool first);
  /* A child that is none of the workers ended (run's coordinator). */
  void (*reaped)(sp_supervise *s, pid_t pid, int status);
  /* Once a turn, about every 20 ms. */
  void (*tick)(sp_supervise *s);
  /* Elastic nodes: the world of the incarnation about to start and this
   * host's place in it (AGENT_START); sets s->first_rank. Required when
   * s->max_nodes > 0. */
  void (*place)(sp_supervise *s, uint32_t world, uint32_t node_rank);
} sp_supervise_ops;

struct sp_supervise {
  /* set by the command before sp_supervise_alloc_streams */
  const char *who; /* "agent", "run": "shardplane WHO: ..." */
  /* what the workers do with a signal passed on, for the message (", which
   * checkpoint after the current step and stop"); "" or NULL: nothing said */
  const char *on_signal;
  const sp_supervise_ops *ops;
  void *user;            /* the command's */
  uint32_t n;            /* local workers, at most SP_WORKERS_MAX */
  uint32_t first_rank;   /* the job's rank of local worker 0 */
  uint32_t max_restarts; /* --max-restarts; 0: none */
  /* --nnodes MIN:MAX of an elastic host (0: fixed): the coordinator
   * numbers the host per incarnation, and its workers stopped for a
   * restart wait for the next one, restarts or not (a host joining stops
   * the job without using one up) */
  uint32_t min_nodes, max_nodes;
  /* the current incarnation's world differs from the last one's: a LOCAL
   * checkpoint (one file per rank) cannot be loaded */
  bool world_changed;
  /* the coordinator keeps replica groups going (AgentDown.groups_continue):
   * a worker's death is its to judge, restarts or not */
  bool groups_continue;
  /* the workers' starts before the current one ($SHARDPLANE_RESTART) */
  uint32_t restarts_done;
  /* the coordinator's outages the stream rides out (--coordinator-grace);
   * 0: none */
  uint64_t grace_ms;
  /* --stop-grace; 0: SP_SUPERVISE_STOP_GRACE_DEFAULT_S */
  double stop_grace_s;

  /* the workers of the current incarnation */
  pid_t pids[SP_WORKERS_MAX];
  uint32_t live;
  sp_out_stream *streams; /* local worker i's stdout at 2i, stderr 2i + 1 */
  uint64_t incarnation;
  uint32_t failed; /* workers of this incarnation that failed */
  /* told AGENT_STOP: its workers stopped, it waits for AGENT_START or
   * AGENT_END (its own workers may not have failed: a slow host's are
   * still running when the stop comes) */
  bool stopped;
  /* the stream to the coordinator (AgentSession); NULL: none */
  sp_agent_ctl *ctl;
  /* workers that ended unasked while the coordinator was away, judged
   * once it is back; and the deaths of this incarnation reported, sent
   * again after an outage (a coordinator that died within its decision
   * window lost them; it ignores those of an ended incarnation) */
  struct sp_supervise_end {
    uint32_t local;
    int status;
    uint64_t incarnation;
  } held[SP_WORKERS_MAX], reported[SP_WORKERS_MAX];
  uint32_t n_held, n_reported;

  /* where the supervision stands */
  int ret;         /* the exit code so far */
  int interrupted; /* the signal that arrived and was passed on, or 0 */
  /* after a signal: the workers still running when stop_grace_s ended
   * ("ranks 0, 1 and 2"), stopped without reaching a step boundary; "":
   * every one stopped in time */
  char overdue[160];
  bool extended;   /* the grace was extended: the ranks were moving */
  bool failing;    /* a failure that stops the job was told */
  bool terminated; /* SIGTERM or SIGKILL sent: the ends that follow are ours */
  bool done;       /* the coordinator ended the job */
  bool coord_gone; /* past the grace, or lost keeping no state dir */
  double alive_at; /* when to tell the coordinator which workers live */
  double term_at;  /* when to SIGTERM the workers left; < 0: not due */
  double kill_at;  /* when to SIGKILL them; < 0: not due */
};

/* How often the coordinator is told which workers have a process alive
 * and the host's pressure (AgentUp.alive), for it to tell a descheduled
 * rank from a dead one before declaring it lost. */
#define SP_SUPERVISE_ALIVE_S 1.0

/* SIGINT and SIGTERM set the flag the loop reads (once per process). */
void sp_supervise_catch_signals(void);

/* --stop-grace S: seconds in (0, 86400]. 0, or SP_EINVAL with the flag, the
 * value and what is allowed in d. */
int sp_supervise_stop_grace_parse(const char *flag, const char *value,
                                  double *s, sp_diag *d);

/* The output streams, once for every incarnation (labelled with the job's
 * ranks). SP_SUPERVISE_PROCEED or an exit code (message printed). */
int sp_supervise_alloc_streams(sp_supervise *s);

/* Opens AgentSession at addr (opts: its credentials; shown: the
 * coordinator as messages name it), registers node_rank with s->n workers
 * and s->max_restarts, and waits up to timeout_ms for the coordinator's
 * first word: the incarnation to start (s->incarnation). The stream rides
 * out outages of s->grace_ms. SP_SUPERVISE_PROCEED, or SP_EXIT_UNREACHABLE /
 * SP_EXIT_FAILURE with the message printed. */
int sp_supervise_open_session(sp_supervise *s, const char *addr,
                              const sp_rpc_client_opts *opts, const char *shown,
                              uint32_t node_rank, uint64_t timeout_ms);
/* Says how many outages the session rode out, half-closes and closes it
 * (none open: nothing). */
void sp_supervise_close_session(sp_supervise *s);

/* A failure that stops the job: told (ops->failure), and the first one
 * sets the exit code 1 (unless a signal already set it) and stops the
 * workers after SP_SUPERVISE_GRACE_S. */
void sp_supervise_fail(sp_supervise *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Supervises the workers started until the job is over for this host (see
 * the top). Returns the exit code: 0 every worker finished, 1 a worker
 * failed (or the coordinator ended the job), SP_EXIT_UNREACHABLE the
 * coordinator stayed away past the grace (or went keeping no state dir),
 * 128 + the signal that stopped them. The streams are closed at the end. */
int sp_supervise_run(sp_supervise *s);

/* Stops the workers left: SIGTERM, SIGKILL SP_SUPERVISE_TERM_S later;
 * reaped. */
void sp_supervise_stop(sp_supervise *s);

/* ---- what a restart loads ---- */

/* The checkpoints a directory held when the job began: a restart loads
 * only one the job wrote itself, not one of an earlier job left there. */
typedef struct sp_supervise_ckpt_seen {
  bool present[4]; /* by sp_ckpt_kind */
  dev_t dev[4];
  ino_t ino[4];
  struct timespec mtime[4];
} sp_supervise_ckpt_seen;

/* Notes what dir holds now (dir NULL or without checkpoints: nothing). */
void sp_supervise_ckpt_note(const char *dir, sp_supervise_ckpt_seen *seen);

/* Whether f (sp_ckpt_find of the directory seen noted) holds a checkpoint
 * of kind k written since seen was noted. */
bool sp_supervise_ckpt_new(const sp_supervise_ckpt_seen *seen,
                           const sp_ckpt_found *f, sp_ckpt_kind k);

/* For incarnation s->incarnation (> 0): the last checkpoint in dir written
 * since seen was noted, FULL when dir holds several kinds. Returns true
 * with its folder in out (cap bytes) and its kind in *kind, saying
 * "incarnation N loads DIR (after step K)"; false when there is none,
 * saying from where the incarnation starts instead: first_load, the
 * checkpoint incarnation 0 loaded, when given, else step 0. A LOCAL one
 * counts only while the world is the same (s->world_changed). */
bool sp_supervise_restart_ckpt(const sp_supervise *s, const char *dir,
                               const sp_supervise_ckpt_seen *seen,
                               const char *first_load, char *out, size_t cap,
                               sp_ckpt_kind *kind);

#endif
