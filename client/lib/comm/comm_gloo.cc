// The Gloo backend of sp_comm (the one C++ file of libshardplane).
//
// Why the collectives are written here on Gloo's point-to-point unbound
// buffers instead of calling gloo::allgather / gloo::alltoall:
//   * abort: Gloo has no abort API. A thread blocked inside gloo::allgather
//     waits on buffers it owns privately, so nothing outside can wake it
//     before its timeout. With our own buffers, sp_comm_abort can call
//     UnboundBuffer::abortWaitRecv/abortWaitSend on exactly the buffers the
//     operation is blocked on; it returns as soon as the connections are
//     closed (below), a few milliseconds.
//   * determinism: sums are done on the host by comm_sum.c in member order, so
//     Gloo only has to move bytes; each element of an all-reduce is summed by
//     exactly one member and then copied, so every member holds the same bits
//     even if their floating-point environments differ.
//   * safety: every message's slot encodes the operation and its arguments
//     (dtype, count or bytes, root), so members that disagree (a desynchronised
//     rank) never match each other's messages. Gloo's receive path asserts on a
//     size mismatch in its event-loop thread, where an exception would
//     terminate the process; with mismatched slots it times out instead.
//
// Failure rule: when an operation fails or is cancelled, every connection of
// the communicator is closed before its buffers are released. Gloo's event
// loop writes received data straight into the caller's memory; closing the
// pairs (which takes each pair's lock, the one the loop holds while reading)
// is the only way to be sure no late message lands in memory the caller is
// about to free. Peers then see the connection drop and fail too instead of
// hanging, which is what a lost member should cause. A watchdog thread per
// communicator covers the one failure Gloo does not report to a waiting
// operation (GlooComm::sentinels).
//
// No C++ exception leaves this file: every extern "C" entry point catches
// everything and returns a negative SP_E* code with a message.
#include <gloo/config.h>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>

#include "comm_internal.h"
#include "comm_sum.h"

namespace {

using Ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// ---- SIGPIPE
// -------------------------------------------------------------------

// Gloo writes with writev(2), so a write to a connection the peer has closed
// raises SIGPIPE, whose default action kills the process: a lost member
// would take every other member down with it. A library must not change the
// process's signal dispositions, so SIGPIPE is blocked instead, on the
// threads that write: the calling thread while it is inside Gloo (this
// guard), and Gloo's event-loop thread, which inherits the mask of the
// thread that creates the device. A write then fails with EPIPE, which Gloo
// reports as an error, and the SIGPIPE it raised is consumed here before the
// caller's mask comes back.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    active_ = pthread_sigmask(SIG_BLOCK, &s, &old_) == 0 &&
              !sigismember(&old_, SIGPIPE);
  }
  SigpipeGuard(const SigpipeGuard &) = delete;
  SigpipeGuard &operator=(const SigpipeGuard &) = delete;
  ~SigpipeGuard() {
    // A caller that blocks SIGPIPE itself keeps whatever is pending.
    if (!active_) return;
    sigset_t s, pending;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE)) {
      struct timespec zero = {0, 0};
      while (sigtimedwait(&s, nullptr, &zero) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t old_;
  bool active_ = false;
};

// ---- exceptions that carry our own codes -----------------------------------

// A store callback failed; the code is the callback's, so a coordinator that
// is down reads as such instead of as a Gloo error.
struct StoreError : std::exception {
  int code;
  std::string msg;
  StoreError(int c, std::string m) : code(c), msg(std::move(m)) {}
  const char *what() const noexcept override { return msg.c_str(); }
};

// An operation was woken by sp_comm_abort.
struct Canceled : std::exception {
  const char *what() const noexcept override { return "cancelled"; }
};

// ---- the store bridge
// --------------------------------------------------------

// The record Gloo's rendezvous publishes for one pair, as it should be.
// tcp::Address::bytes() copies the whole of the address: a sockaddr_storage
// filled by getsockname, whose bytes past the socket address itself are left
// as they were (stack garbage: pointers, pieces of earlier messages), then
// the sequence number. Rewritten field by field into a zeroed buffer, in the
// layout the readers' Address(bytes) expects, the record holds the address,
// port and sequence number and zeros elsewhere (padding included).
class CleanAddress : public gloo::transport::tcp::Address {
 public:
  static constexpr size_t kSize = sizeof(Impl);

  explicit CleanAddress(const std::vector<char> &bytes) : Address(bytes) {}

  // Appends the clean record; false for a family Gloo's TCP transport does
  // not use (its length would be unknown).
  bool append_to(std::vector<char> &out) const {
    size_t used;
    if (impl_.ss.ss_family == AF_INET)
      used = sizeof(struct sockaddr_in);
    else if (impl_.ss.ss_family == AF_INET6)
      used = sizeof(struct sockaddr_in6);
    else
      return false;
    size_t at = out.size();
    out.resize(at + kSize, 0);
    std::memcpy(out.data() + at + offsetof(Impl, ss), &impl_.ss, used);
    std::memcpy(out.data() + at + offsetof(Impl, seq), &impl_.seq,
                sizeof impl_.seq);
    return true;
  }
};

// A key Gloo's connectFullMesh publishes pair addresses under: "<rank>".
bool is_address_key(const std::string &key) {
  return !key.empty() &&
         std::all_of(key.begin(), key.end(),
                     [](unsigned char c) { return std::isdigit(c) != 0; });
}

// Gloo's rendezvous (connectFullMesh) publishes each member's pair addresses
// under the key "<rank>" and then waits for and reads every other member's.
// Keys are namespaced as "<prefix>/<rank>". One deadline covers the whole
// rendezvous: Gloo passes its own timeout to every wait, which would let a
// rendezvous with W members take up to W-1 timeouts.
class CStore : public gloo::rendezvous::Store {
 public:
  CStore(const sp_comm_store &s, const std::string &prefix,
         Clock::time_point deadline, uint64_t timeout_ms)
      : s_(s), prefix_(prefix), deadline_(deadline), timeout_ms_(timeout_ms) {}

  void set(const std::string &key, const std::vector<char> &data) override {
    std::string full = prefix_ + "/" + key;
    std::vector<char> clean;
    const bool addresses = is_address_key(key);
    if (addresses) clean_addresses(full, data, clean);
    const std::vector<char> &out = addresses ? clean : data;
    sp_diag d{};
    int rc = s_.set(s_.user, full.c_str(), out.data(), out.size(), &d);
    if (rc < 0) throw StoreError(rc, "store set '" + full + "': " + d.msg);
  }

  std::vector<char> get(const std::string &key) override {
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      std::vector<char> v = std::move(it->second);
      cache_.erase(it);
      return v;
    }
    return fetch(key);
  }

  void wait(const std::vector<std::string> &keys) override {
    for (const auto &k : keys)
      if (cache_.find(k) == cache_.end()) cache_[k] = fetch(k);
  }

  void wait(const std::vector<std::string> &keys, const Ms &) override {
    wait(keys);
  }

 private:
  // Only what each address needs goes to the store (CleanAddress).
  static void clean_addresses(const std::string &full,
                              const std::vector<char> &data,
                              std::vector<char> &out) {
    const size_t k = CleanAddress::kSize;
    if (data.size() % k != 0)
      throw StoreError(SP_EIO, "store set '" + full +
                                   "': a rendezvous record "
                                   "of " +
                                   std::to_string(data.size()) +
                                   " bytes is not a whole number of " +
                                   std::to_string(k) + "-byte Gloo addresses");
    out.reserve(data.size());
    for (size_t at = 0; at < data.size(); at += k) {
      CleanAddress a(
          std::vector<char>(data.begin() + (std::ptrdiff_t)at,
                            data.begin() + (std::ptrdiff_t)(at + k)));
      if (!a.append_to(out))
        throw StoreError(SP_EIO, "store set '" + full +
                                     "': a Gloo address "
                                     "of an unexpected family");
    }
  }

  std::vector<char> fetch(const std::string &key) {
    std::string full = prefix_ + "/" + key;
    auto left = std::chrono::duration_cast<Ms>(deadline_ - Clock::now());
    // wait_ms 0 means "do not wait" to the callback: one last look at the
    // store once the deadline has passed.
    uint64_t wait_ms = left.count() > 0 ? (uint64_t)left.count() : 0;
    uint8_t *val = nullptr;
    size_t len = 0;
    sp_diag d{};
    int rc = s_.get(s_.user, full.c_str(), wait_ms, &val, &len, &d);
    if (rc == SP_ETIMEDOUT || rc == SP_ENOENT) {
      std::free(val);
      throw StoreError(SP_ETIMEDOUT, "timed out after " +
                                         std::to_string(timeout_ms_) +
                                         " ms waiting for rank " + key +
                                         " to join (store key '" + full + "')");
    }
    if (rc < 0) {
      std::free(val);
      throw StoreError(rc, "store get '" + full + "': " + d.msg);
    }
    std::unique_ptr<uint8_t, decltype(&std::free)> owned(val, &std::free);
    if (len > 0 && val == nullptr)
      throw StoreError(SP_EIO, "store get '" + full + "' returned no value");
    return std::vector<char>(reinterpret_cast<char *>(val),
                             reinterpret_cast<char *>(val) + len);
  }

  const sp_comm_store &s_;
  const std::string &prefix_;
  const Clock::time_point deadline_;
  const uint64_t timeout_ms_;
  std::map<std::string, std::vector<char>> cache_;
};

// ---- the communicator
// --------------------------------------------------------

// A member's connection failed while this member's operation waits for a
// send to it (see GlooComm::watch).
// A new thread starts with its creator's name: a thread named "gloo"
// while Gloo starts its event loop gives that loop the name, and gets its
// own back after.
struct ThreadNameScope {
  explicit ThreadNameScope(const char *name) {
    named_ = pthread_getname_np(pthread_self(), own_, sizeof own_) == 0;
    if (named_) pthread_setname_np(pthread_self(), name);
  }
  ~ThreadNameScope() {
    if (named_) pthread_setname_np(pthread_self(), own_);
  }
  ThreadNameScope(const ThreadNameScope &) = delete;
  ThreadNameScope &operator=(const ThreadNameScope &) = delete;

 private:
  char own_[16] = "";
  bool named_ = false;
};

struct PeerFailed : std::runtime_error {
  explicit PeerFailed(const std::string &m) : std::runtime_error(m) {}
};

// Slot of the sentinel receives; operation slots keep the top bit clear.
constexpr uint64_t kSentinelSlot = ~0ull;

struct GlooComm {
  std::string prefix;
  int rank = 0;
  int size = 0;
  uint64_t timeout_ms = 0;
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;

  // Guards everything below: abort and the watchdog wake exactly the
  // buffers registered in active, and an operation unregisters its buffers
  // (under this lock) before destroying them, so nobody touches a freed
  // buffer.
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  bool stop = false;
  std::string peer_failure;  // non-empty once a connection has failed
  // The members whose data the last failed operation never received
  // (Op::missing), for its error message.
  std::string last_missing;
  std::vector<UnboundBuffer *> active;

  // One receive per peer, posted at creation on a slot nobody sends to.
  // Gloo signals a failed connection only to the buffers with transfers
  // pending on it, and not to a send already being written (a large send
  // whose peer stopped reading): the thread waiting for that send would sit
  // until the timeout. The sentinel is always pending, so it always learns
  // of the failure; the watchdog looks at the sentinels while an operation
  // is in progress and wakes it.
  std::vector<std::unique_ptr<UnboundBuffer>> sentinels;
  std::vector<unsigned char> sentinel_bytes;
  std::thread watchdog;

  // Operations issued; all members issue the same sequence, so this is the
  // same on all of them for the same operation.
  uint64_t seq = 0;

  bool is_aborted() {
    std::lock_guard<std::mutex> lk(mu);
    return aborted;
  }

  // Idempotent; Pair::close takes the pair's lock, which the event loop
  // holds while it reads into a buffer, so after this returns no receive is
  // in progress and none will start.
  void close_all() noexcept {
    try {
      if (ctx) ctx->closeConnections();
    } catch (...) {
      // Closing is best effort: a pair that fails to close is one whose
      // socket is already gone.
    }
  }

  // Posts the sentinels and starts the watchdog (after the rendezvous).
  void start_watch() {
    sentinel_bytes.assign((size_t)size, 0);
    sentinels.resize((size_t)size);
    for (int i = 0; i < size; i++) {
      if (i == rank) continue;
      sentinels[(size_t)i] =
          ctx->createUnboundBuffer(&sentinel_bytes[(size_t)i], 1);
      sentinels[(size_t)i]->recv(i, kSentinelSlot, 0, 1);
    }
    watchdog = std::thread([this] {
      pthread_setname_np(pthread_self(), "gloo-watchdog");
      watch();
    });
  }

  // Whether the connection of sentinel s is still up: a waitRecv that is
  // told beforehand to give up returns false at once, unless the buffer
  // holds an error, which it throws first.
  static bool healthy(UnboundBuffer *s, std::string *why) {
    try {
      s->abortWaitRecv();
      s->waitRecv(nullptr, Ms(1));
      return true;
    } catch (const std::exception &e) {
      *why = e.what();
      return false;
    }
  }

  // 20 ms between looks: a lost member is noticed well within a second,
  // and an idle communicator costs 50 wake-ups a second.
  void watch() noexcept {
    try {
      std::unique_lock<std::mutex> lk(mu);
      while (!stop) {
        cv.wait_for(lk, Ms(20));
        if (stop || aborted || !peer_failure.empty() || active.empty())
          continue;
        lk.unlock();
        std::string why;
        int bad = -1;
        for (int i = 0; i < size && bad < 0; i++)
          if (sentinels[(size_t)i] &&
              !healthy(sentinels[(size_t)i].get(), &why))
            bad = i;
        lk.lock();
        if (bad >= 0 && peer_failure.empty()) {
          peer_failure =
              "connection to rank " + std::to_string(bad) + " lost: " + why;
          for (UnboundBuffer *b : active) {
            b->abortWaitRecv();
            b->abortWaitSend();
          }
        }
      }
    } catch (...) {
      // Without the watchdog, a send stuck on a dead connection still ends
      // at the operation's timeout.
    }
  }

  ~GlooComm() {
    if (watchdog.joinable()) {
      {
        std::lock_guard<std::mutex> lk(mu);
        stop = true;
      }
      cv.notify_all();
      watchdog.join();
    }
    // Sentinels, then the pairs, then the device that runs their event
    // loop.
    sentinels.clear();
    ctx.reset();
    dev.reset();
  }
};

enum OpKind : uint32_t {
  kAllGather = 1,
  kReduceScatter = 2,
  kAllReduceScatter = 3,
  kAllReduceGather = 4,
  kBroadcast = 5,
  kBarrier = 6,
};

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One collective in progress: its buffers (registered for abort), its
// deadline, its slots.
class Op {
 public:
  Op(GlooComm &g, uint64_t a, uint64_t b, uint64_t c)
      : g_(g),
        deadline_(Clock::now() + Ms(g.timeout_ms)),
        seq_(g.seq++),
        a_(a),
        b_(b),
        c_(c),
        posted_((size_t)g.size),
        got_((size_t)g.size) {}

  Op(const Op &) = delete;
  Op &operator=(const Op &) = delete;

  ~Op() {
    if (!done_) g_.close_all();
    std::lock_guard<std::mutex> lk(g_.mu);
    for (auto &b : bufs_) {
      auto it = std::find(g_.active.begin(), g_.active.end(), b.get());
      if (it != g_.active.end()) g_.active.erase(it);
    }
  }

  // The slot of one phase: the low half names the operation and its
  // arguments, the high half its place in the sequence (31 bits: slots
  // with the top bit set belong to the sentinels).
  // round: the round of an operation moved in several (0 for the first,
  // which keeps the slot of an operation of one round).
  uint64_t slot(OpKind kind, uint64_t round = 0) const {
    uint64_t h = mix64(mix64(mix64(mix64((uint64_t)kind) ^ a_) ^ b_) ^ c_);
    if (round) h = mix64(h ^ round);
    return ((seq_ & 0x7FFFFFFFull) << 32) | (h & 0xFFFFFFFFull);
  }

  // Memory Gloo transfers into or out of must be owned here, not by the
  // body of the operation: an exception unwinds the body's locals before
  // the catch can close the connections, and the event loop may still be
  // reading into them until it is closed.
  unsigned char *scratch(size_t nbytes) {
    scratch_.emplace_back(new unsigned char[nbytes > 0 ? nbytes : 1]);
    return scratch_.back().get();
  }

  UnboundBuffer *buffer(void *ptr, size_t nbytes) {
    auto b = g_.ctx->createUnboundBuffer(ptr, nbytes);
    std::lock_guard<std::mutex> lk(g_.mu);
    if (g_.aborted) throw Canceled();
    if (!g_.peer_failure.empty()) throw PeerFailed(g_.peer_failure);
    bufs_.reserve(bufs_.size() + 1);
    g_.active.reserve(g_.active.size() + 1);
    g_.active.push_back(b.get());
    bufs_.push_back(std::move(b));
    return bufs_.back().get();
  }

  // Every receive of an operation goes through here, and its wait learns
  // which peer's data came, so a timeout can name the members whose data
  // never did.
  void recv(UnboundBuffer *b, int peer, uint64_t slot, size_t off,
            size_t nbytes) {
    if (peer >= 0 && peer < g_.size) posted_[(size_t)peer]++;
    b->recv(peer, slot, off, nbytes);
  }
  void wait_recv(UnboundBuffer *b) {
    int src = -1;
    if (!b->waitRecv(&src, left())) woken();
    if (src >= 0 && src < g_.size) got_[(size_t)src]++;
  }
  // "member 2", "members 1, 3": those whose posted receives did not all
  // complete; empty when every one did.
  std::string missing() const {
    std::string s;
    int n = 0;
    for (size_t i = 0; i < posted_.size(); i++)
      if (got_[i] < posted_[i]) {
        s += (n++ ? ", " : "") + std::to_string(i);
      }
    return n == 0 ? s : (n == 1 ? "member " : "members ") + s;
  }
  void wait_send(UnboundBuffer *b) {
    if (!b->waitSend(nullptr, left())) woken();
  }

  bool past_deadline() const { return Clock::now() >= deadline_; }
  GlooComm &comm() { return g_; }

  // Every transfer completed: the connections stay open.
  void finish() { done_ = true; }

 private:
  // A wait returned false: abort or the watchdog told it to give up.
  [[noreturn]] void woken() {
    std::lock_guard<std::mutex> lk(g_.mu);
    if (g_.aborted || g_.peer_failure.empty()) throw Canceled();
    throw PeerFailed(g_.peer_failure);
  }

  // Gloo treats 0 as "no timeout" and a negative value as "the context's
  // default", so the remaining time never goes below 1 ms.
  Ms left() const {
    auto r = std::chrono::duration_cast<Ms>(deadline_ - Clock::now());
    return std::max(r, Ms(1));
  }

  GlooComm &g_;
  const Clock::time_point deadline_;
  const uint64_t seq_;
  const uint64_t a_, b_, c_;
  std::vector<uint32_t> posted_, got_;  // receives per peer: posted, done
  bool done_ = false;
  // Declared before bufs_ so that it outlives them.
  std::vector<std::unique_ptr<unsigned char[]>> scratch_;
  std::vector<std::unique_ptr<UnboundBuffer>> bufs_;
};

bool mentions_timeout(const char *what) {
  std::string s(what);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char ch) { return (char)std::tolower(ch); });
  return s.find("timed out") != std::string::npos ||
         s.find("timeout") != std::string::npos;
}

// The exception boundary of every operation. f may throw anything; the
// communicator's state decides how a Gloo error reads: after an abort any
// error is the abort's doing.
template <typename F>
int guarded(GlooComm *g, sp_diag *d, F &&f) noexcept {
  SigpipeGuard nosigpipe;
  bool timed_out = false;
  try {
    f(timed_out);
    return 0;
  } catch (const Canceled &) {
    return sp_diag_set(d, SP_ECANCELED, "cancelled by sp_comm_abort");
  } catch (const std::bad_alloc &) {
    if (g->is_aborted())
      return sp_diag_set(d, SP_ECANCELED, "cancelled by sp_comm_abort");
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  } catch (const std::exception &e) {
    try {
      if (g->is_aborted())
        return sp_diag_set(d, SP_ECANCELED,
                           "cancelled by sp_comm_abort (gloo: %s)", e.what());
      std::string who;
      {
        std::lock_guard<std::mutex> lk(g->mu);
        who = g->last_missing;
      }
      if ((timed_out || mentions_timeout(e.what())) && !who.empty())
        return sp_diag_set(d, SP_ETIMEDOUT,
                           "timed out after %llu ms: %s of this %d-member "
                           "communicator (this rank is member %d) did not "
                           "take part, or issued a different collective "
                           "(gloo: %s)",
                           (unsigned long long)g->timeout_ms, who.c_str(),
                           g->size, g->rank, e.what());
      if (timed_out || mentions_timeout(e.what()))
        return sp_diag_set(d, SP_ETIMEDOUT,
                           "timed out after %llu ms: a member did not take "
                           "part, or members issued different collectives "
                           "(gloo: %s)",
                           (unsigned long long)g->timeout_ms, e.what());
      return sp_diag_set(d, SP_EIO, "connection to a member failed (gloo: %s)",
                         e.what());
    } catch (...) {
      return sp_diag_set(d, SP_EIO, "gloo error");
    }
  } catch (...) {
    return sp_diag_set(d, SP_EIO, "unknown C++ exception from gloo");
  }
}

// Runs the body of a collective; on an exception decides, before the Op (and
// its buffers) is destroyed, whether the deadline had passed.
template <typename B>
void run_op(Op &op, bool &timed_out, B &&body) {
  try {
    body();
    op.finish();
  } catch (...) {
    timed_out = op.past_deadline();
    std::string m = op.missing();
    std::lock_guard<std::mutex> lk(op.comm().mu);
    op.comm().last_missing = m;
    throw;
  }
}

// ---- collectives
// -------------------------------------------------------------

void do_all_gather(GlooComm &g, const void *send, void *recv, size_t nbytes,
                   bool &timed_out) {
  Op op(g, nbytes, 0, 0);
  run_op(op, timed_out, [&] {
    auto *out = static_cast<unsigned char *>(recv);
    unsigned char *mine = out + (size_t)g.rank * nbytes;
    // The own block travels from its place in recv, so send may alias it
    // (and need not stay valid while the peers are served).
    if (send != mine) std::memmove(mine, send, nbytes);
    UnboundBuffer *b = op.buffer(out, nbytes * (size_t)g.size);
    const uint64_t slot = op.slot(kAllGather);
    for (int i = 0; i < g.size; i++) {
      if (i == g.rank) continue;
      op.recv(b, i, slot, (size_t)i * nbytes, nbytes);
      b->send(i, slot, (size_t)g.rank * nbytes, nbytes);
    }
    for (int i = 1; i < g.size; i++) op.wait_recv(b);
    for (int i = 1; i < g.size; i++) op.wait_send(b);
  });
}

// The peers' data of a reduce-scatter (and of an all-reduce's scatter
// phase) moves in rounds of at most this many bytes per peer, so the
// scratch it lands in is size * 1 MiB whatever the count: received whole,
// GPT-2's 39 M-element root unit needed a 158 MB scratch (size * count
// bytes) per reduction, as much as the FSDP runtime's whole unsharded
// gradient of that unit. Sums are element-wise, so the rounds give the
// bits of one; on loopback a round costs about 50 us, and a 1 MiB round
// moves in about 0.3 ms.
constexpr size_t kRoundBytes = size_t(1) << 20;

void do_reduce_scatter(GlooComm &g, const void *send, void *recv, size_t count,
                       sp_dtype dt, bool &timed_out) {
  const size_t esz = sp_dtype_size(dt);
  const size_t nbytes = count * esz;
  const size_t per = std::max<size_t>(1, kRoundBytes / esz);
  const size_t chunk = std::min(per, count);
  Op op(g, count, (uint64_t)dt, 0);
  run_op(op, timed_out, [&] {
    // Block i of tmp receives this round's part of member i's block
    // `rank`; the own block is read in place.
    unsigned char *tmp = op.scratch(chunk * esz * (size_t)g.size);
    auto *in = static_cast<unsigned char *>(const_cast<void *>(send));
    auto *out = static_cast<unsigned char *>(recv);
    UnboundBuffer *sb = op.buffer(in, nbytes * (size_t)g.size);
    UnboundBuffer *rb = op.buffer(tmp, chunk * esz * (size_t)g.size);
    std::vector<const void *> blocks((size_t)g.size);
    for (size_t e0 = 0, round = 0; e0 < count; e0 += per, round++) {
      const size_t k = std::min(per, count - e0);
      const uint64_t slot = op.slot(kReduceScatter, round);
      for (int i = 0; i < g.size; i++) {
        if (i == g.rank) continue;
        op.recv(rb, i, slot, (size_t)i * chunk * esz, k * esz);
        sb->send(i, slot, ((size_t)i * count + e0) * esz, k * esz);
      }
      for (int i = 1; i < g.size; i++) op.wait_recv(rb);
      for (int i = 1; i < g.size; i++) op.wait_send(sb);
      for (int i = 0; i < g.size; i++)
        blocks[(size_t)i] = i == g.rank ? in + ((size_t)i * count + e0) * esz
                                        : tmp + (size_t)i * chunk * esz;
      // Every send of this round has completed, so recv may overlap send:
      // the sum reads each chunk of every block before writing that
      // chunk, and later rounds read only later parts of the own block.
      if (sp_comm_sum_blocks(out + e0 * esz, blocks.data(), (uint32_t)g.size, k,
                             dt) < 0)
        throw std::invalid_argument("no sum for this dtype");
    }
  });
}

// Reduce-scatter over ceil(count / size) blocks, each summed by its owner,
// then an all-gather of the sums: every element is computed once, so every
// member gets the owner's bits. Trailing blocks may be short or empty.
void do_all_reduce(GlooComm &g, void *buf, size_t count, sp_dtype dt,
                   bool &timed_out) {
  const size_t esz = sp_dtype_size(dt);
  const size_t w = (size_t)g.size;
  const size_t chunk = count / w + (count % w != 0);
  auto off = [&](size_t j) { return std::min(j * chunk, count); };
  auto len = [&](size_t j) { return std::min(chunk, count - off(j)); };
  const size_t me = (size_t)g.rank;
  const size_t mylen = len(me);
  // the scatter phase in rounds of kRoundBytes per peer (see
  // do_reduce_scatter): round r moves elements [r * per, (r + 1) * per) of
  // every segment; a short or empty segment just ends sooner
  const size_t per = std::max<size_t>(1, kRoundBytes / esz);
  const size_t part = std::min(per, mylen);
  Op op(g, count, (uint64_t)dt, 0);
  run_op(op, timed_out, [&] {
    auto *data = static_cast<unsigned char *>(buf);
    unsigned char *tmp = op.scratch(part * esz * w);
    UnboundBuffer *db = op.buffer(data, count * esz);
    UnboundBuffer *tb = op.buffer(tmp, part * esz * w);
    std::vector<const void *> blocks(w);
    for (size_t e0 = 0, round = 0; e0 < chunk; e0 += per, round++) {
      auto piece = [&](size_t j) {
        return len(j) > e0 ? std::min(per, len(j) - e0) : 0;
      };
      const size_t k = piece(me);
      const uint64_t slot = op.slot(kAllReduceScatter, round);
      int nrecv = 0, nsend = 0;
      for (size_t i = 0; i < w; i++) {
        if (i == me) continue;
        if (k > 0) {
          op.recv(tb, (int)i, slot, i * part * esz, k * esz);
          nrecv++;
        }
        if (piece(i) > 0) {
          db->send((int)i, slot, (off(i) + e0) * esz, piece(i) * esz);
          nsend++;
        }
      }
      for (int i = 0; i < nrecv; i++) op.wait_recv(tb);
      for (int i = 0; i < nsend; i++) op.wait_send(db);
      if (k > 0) {
        for (size_t i = 0; i < w; i++)
          blocks[i] =
              i == me ? data + (off(me) + e0) * esz : tmp + i * part * esz;
        if (sp_comm_sum_blocks(data + (off(me) + e0) * esz, blocks.data(),
                               (uint32_t)w, k, dt) < 0)
          throw std::invalid_argument("no sum for this dtype");
      }
    }
    // Peers post their gather receives only after their own scatter phase,
    // and a receive is never filled before it is posted (Gloo sends data
    // only to a receive the peer has announced), so reusing buf is safe.
    const uint64_t slot = op.slot(kAllReduceGather);
    int nrecv = 0, nsend = 0;
    for (size_t i = 0; i < w; i++) {
      if (i == me) continue;
      if (len(i) > 0) {
        op.recv(db, (int)i, slot, off(i) * esz, len(i) * esz);
        nrecv++;
      }
      if (mylen > 0) {
        db->send((int)i, slot, off(me) * esz, mylen * esz);
        nsend++;
      }
    }
    for (int i = 0; i < nrecv; i++) op.wait_recv(db);
    for (int i = 0; i < nsend; i++) op.wait_send(db);
  });
}

void do_broadcast(GlooComm &g, void *buf, size_t nbytes, uint32_t root,
                  bool &timed_out) {
  Op op(g, nbytes, root, 0);
  run_op(op, timed_out, [&] {
    UnboundBuffer *b = op.buffer(buf, nbytes);
    const uint64_t slot = op.slot(kBroadcast);
    if ((uint32_t)g.rank == root) {
      for (int i = 0; i < g.size; i++)
        if (i != g.rank) b->send(i, slot, 0, nbytes);
      for (int i = 1; i < g.size; i++) op.wait_send(b);
    } else {
      op.recv(b, (int)root, slot, 0, nbytes);
      op.wait_recv(b);
    }
  });
}

// Everyone tells everyone it has arrived; leaving after hearing from all
// means all have arrived.
void do_barrier(GlooComm &g, bool &timed_out) {
  Op op(g, 0, 0, 0);
  run_op(op, timed_out, [&] {
    unsigned char *tokens = op.scratch((size_t)g.size);
    std::memset(tokens, 1, (size_t)g.size);
    UnboundBuffer *b = op.buffer(tokens, (size_t)g.size);
    const uint64_t slot = op.slot(kBarrier);
    for (int i = 0; i < g.size; i++) {
      if (i == g.rank) continue;
      op.recv(b, i, slot, (size_t)i, 1);
      b->send(i, slot, (size_t)g.rank, 1);
    }
    for (int i = 1; i < g.size; i++) op.wait_recv(b);
    for (int i = 1; i < g.size; i++) op.wait_send(b);
  });
}

// ---- creation
// ----------------------------------------------------------------

std::string gloo_host(const sp_comm_info *info) {
  if (info->host != nullptr && info->host[0] != '\0')
    return std::string(info->host);
  const char *h = std::getenv(SP_GLOO_HOST_ENV);
  return h != nullptr && h[0] != '\0' ? std::string(h)
                                      : std::string("127.0.0.1");
}

int gloo_create(const sp_comm_info *info, const sp_comm_store *store,
                void **impl, sp_diag *d) noexcept {
  // Also makes the device's event-loop thread, created below, start with
  // SIGPIPE blocked for good.
  SigpipeGuard nosigpipe;
  *impl = nullptr;
  std::unique_ptr<GlooComm> g;
  std::string host;
  try {
    g.reset(new GlooComm());
    g->prefix = info->prefix;
    g->rank = (int)info->rank;
    g->size = (int)info->size;
    g->timeout_ms = info->timeout_ms;
    host = gloo_host(info);
  } catch (...) {
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  }
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    ThreadNameScope as_gloo("gloo");
    g->dev = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception &e) {
    return sp_diag_set(
        d, SP_EIO,
        "cannot create a TCP device on host '%s' (set " SP_GLOO_HOST_ENV
        "): %s",
        host.c_str(), e.what());
  } catch (...) {
    return sp_diag_set(d, SP_EIO, "cannot create a TCP device on host '%s'",
                       host.c_str());
  }
  try {
    const auto deadline = Clock::now() + Ms(info->timeout_ms);
    g->ctx = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
    // Gloo waits up to 5 pair timeouts for a connection to be made once
    // both addresses are known (a peer that published its address and then
    // died); a fifth keeps that wait within the communicator's timeout.
    g->ctx->setTimeout(Ms(std::max<uint64_t>(1, info->timeout_ms / 5)));
    CStore st(*store, g->prefix, deadline, info->timeout_ms);
    g->ctx->connectFullMesh(st, g->dev);
    g->start_watch();
  } catch (const StoreError &e) {
    return sp_diag_set(d, e.code, "%s", e.what());
  } catch (const std::bad_alloc &) {
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  } catch (const std::exception &e) {
    int rc = mentions_timeout(e.what()) ? SP_ETIMEDOUT : SP_EIO;
    return sp_diag_set(d, rc, "connecting to the other members over '%s': %s",
                       host.c_str(), e.what());
  } catch (...) {
    return sp_diag_set(d, SP_EIO, "unknown C++ exception from gloo");
  }
  *impl = g.release();
  return 0;
}

}  // namespace

// ---- the C entry points
// --------------------------------------------------------

extern "C" {

static int gb_barrier(void *impl, sp_diag *d);
static void gb_destroy(void *impl);

static int gb_create(const sp_comm_info *info, const sp_comm_store *store,
                     void **impl, sp_diag *d) {
  int rc = gloo_create(info, store, impl, d);
  if (rc != 0) return rc;
  // connectFullMesh returns on a member once its own pairs are connected,
  // which may be before a peer has handled its side of the connection. A
  // member that then aborted (closing its sockets) made that peer's Gloo
  // event-loop thread throw from getpeername, and an exception on that
  // thread terminates the process. A barrier over every pair first means
  // no member leaves creation before all of them have finished connecting.
  rc = gb_barrier(*impl, d);
  if (rc != 0) {
    gb_destroy(*impl);
    *impl = nullptr;
  }
  return rc;
}

static void gb_destroy(void *impl) {
  try {
    delete static_cast<GlooComm *>(impl);
  } catch (...) {
    // A destructor that throws leaves nothing for the caller to do.
  }
}

static int gb_all_gather(void *impl, const void *send, void *recv,
                         size_t nbytes, sp_diag *d) {
  auto *g = static_cast<GlooComm *>(impl);
  return guarded(g, d,
                 [&](bool &to) { do_all_gather(*g, send, recv, nbytes, to); });
}

static int gb_reduce_scatter(void *impl, const void *send, void *recv,
                             size_t count, sp_dtype dt, sp_diag *d) {
  auto *g = static_cast<GlooComm *>(impl);
  return guarded(g, d, [&](bool &to) {
    do_reduce_scatter(*g, send, recv, count, dt, to);
  });
}

static int gb_all_reduce(void *impl, void *buf, size_t count, sp_dtype dt,
                         sp_diag *d) {
  auto *g = static_cast<GlooComm *>(impl);
  return guarded(g, d,
                 [&](bool &to) { do_all_reduce(*g, buf, count, dt, to); });
}

static int gb_broadcast(void *impl, void *buf, size_t nbytes, uint32_t root,
                        sp_diag *d) {
  auto *g = static_cast<GlooComm *>(impl);
  return guarded(g, d,
                 [&](bool &to) { do_broadcast(*g, buf, nbytes, root, to); });
}

static int gb_barrier(void *impl, sp_diag *d) {
  auto *g = static_cast<GlooComm *>(impl);
  return guarded(g, d, [&](bool &to) { do_barrier(*g, to); });
}

static void gb_abort(void *impl) {
  auto *g = static_cast<GlooComm *>(impl);
  try {
    {
      std::lock_guard<std::mutex> lk(g->mu);
      g->aborted = true;
      // A flag set on a buffer nobody waits on yet is kept, so an operation
      // between posting and waiting still sees it.
      for (UnboundBuffer *b : g->active) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
    }
    // Peers blocked on this member see the connections drop and fail
    // instead of waiting for their timeout.
    g->close_all();
  } catch (...) {
    // Only a failing mutex could get here; the flag may not be set, but
    // there is nothing better to do from a void function.
  }
}

static const sp_comm_backend gloo_backend = {
    "gloo",
    gb_create,
    gb_destroy,
    gb_all_gather,
    gb_reduce_scatter,
    gb_all_reduce,
    gb_broadcast,
    gb_barrier,
    gb_abort,
    nullptr,  // cuda_stream: host memory, no stream
    0,        // device_buffers
};

const sp_comm_backend *sp_comm_gloo_backend(void) { return &gloo_backend; }

}  // extern "C"
