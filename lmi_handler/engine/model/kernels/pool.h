// The kernels' own worker threads: a parallel region's pieces are claimed by whichever threads are running, and
// the region ends when its pieces are done, not when every thread has checked in. A thread the OS has taken off its
// core (another process on it, a CPU quota spent) then holds back only the piece it holds: the caller and the other
// workers take the rest, and a worker that wakes up late finds the region finished and joins the next one. (The
// OpenMP regions these replaced ended at a barrier every thread had to reach: with one core busy elsewhere, each of a
// decode step's ~150 regions waited a scheduler slice for the descheduled thread, issue 47.)
//
// Waits spin briefly and then block on a futex (no unbounded spinning): a worker idles SPIN_IDLE_NS between regions,
// the caller SPIN_DONE_NS for the last pieces. Which thread runs a piece never changes its bits: pieces write
// disjoint outputs, each through its own fixed order of operations (the callers' rule, see each header).
// One pool for the whole extension (a named namespace: both translation units share it). A region started while
// another runs (a second Python thread) or from inside a piece runs on its calling thread alone, in order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmi_pool {

constexpr int64_t SPIN_IDLE_NS = 100'000;   // a worker's spin for the next region before it sleeps
constexpr int64_t SPIN_DONE_NS = 30'000;    // the caller's spin for the other threads' last pieces
constexpr int MAX_THREADS = 256;

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  std::this_thread::yield();
  (void)word, (void)expected;
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, MAX_THREADS, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Claim order (tests): 0 the natural one (a counter, or each thread's own share first: walk), 1 reversed, 2 a fresh
// random permutation each region. Set by set_claim_order; any order must give the same bits.
inline std::atomic<int> claim_order{0};
// Tests: each worker sleeps this long (microseconds) after it sees a new region and before it joins it (a thread the
// OS took off its core just then); 0 in use.
inline std::atomic<int64_t> worker_delay_us{0};
// The thread count, 0: torch's (at::get_num_threads()). Set by set_threads (num_threads=auto's adaptation).
inline std::atomic<int> threads_setting{0};

inline int threads() {
  const int set = threads_setting.load(std::memory_order_relaxed);
  return std::min(MAX_THREADS, set > 0 ? set : std::max(1, at::get_num_threads()));
}

// this thread's participant number in the region it runs a piece of (0: the caller), -1 outside one
inline thread_local int slot = -1;
inline bool in_region() { return slot >= 0 || at::in_parallel_region(); }

// One region: n pieces, call(ctx, piece). walk: the pieces are `shares` contiguous shares, participant s walks
// share s from its front and then takes pieces from the back of the others' (items that prefetch the next one
// want their successor to be their own); else one counter hands the pieces out in order.
struct Job {
  int64_t n = 0;
  void (*call)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;
  int shares = 0;                    // walk: the number of shares; 0: counter
  std::vector<int64_t> order;        // claim_order != 0: the k-th claim runs piece order[k]
};

constexpr uint64_t OPEN = uint64_t{1} << 31;
constexpr uint64_t INSIDE = OPEN - 1;

// Two slots, used by alternate regions: a worker still inside region g (between its last claim and leaving) holds
// slot g & 1, which region g + 2 reuses only once it left; region g + 1 never waits for it.
struct alignas(64) Slot {
  std::atomic<uint64_t> entry{0};    // gen << 32 | OPEN while claimable | threads inside
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<uint32_t> done{0};
  std::atomic<uint32_t> caller_asleep{0};
  std::atomic<int> tickets{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;
  Job job;
  struct alignas(64) Share { std::atomic<uint64_t> state; };   // front | back << 32
  std::vector<Share> shares = std::vector<Share>(MAX_THREADS);
};

class Pool {
 public:
  // f(piece) for each of n pieces over threads() threads (the caller one of them); returns when all ran. An
  // exception in a piece skips the pieces not yet started and is re-thrown here (the first one).
  template <class F>
  void run(int64_t n, bool walk, const F& f) {
    if (n <= 0) return;
    const int width = static_cast<int>(std::min<int64_t>(threads(), n));
    if (width <= 1 || in_region() || n >= (int64_t{1} << 31)) {   // nested: never try the lock this thread holds
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    std::unique_lock<std::mutex> owner(owner_mu_, std::try_to_lock);
    if (!owner.owns_lock()) {   // another caller's region runs: this one runs inline
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    grow(width - 1);
    const uint32_t gen = epoch_.load(std::memory_order_relaxed) + 1;
    Slot& s = slots_[gen & 1];
    while ((s.entry.load(std::memory_order_acquire) & INSIDE) != 0) std::this_thread::yield();   // region gen - 2's
    Job& job = s.job;
    job.n = n;
    job.call = [](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
    job.ctx = &f;
    job.shares = walk ? width : 0;
    const int mode = claim_order.load(std::memory_order_relaxed);
    job.order.clear();
    if (mode != 0) {
      job.order.resize(n);
      for (int64_t i = 0; i < n; ++i) job.order[i] = mode == 1 ? n - 1 - i : i;
      if (mode == 2) std::shuffle(job.order.begin(), job.order.end(), std::mt19937_64(rng_()));
      job.shares = 0;
    }
    for (int t = 0; t < job.shares; ++t) {
      const uint64_t front = static_cast<uint64_t>(n * t / width), back = static_cast<uint64_t>(n * (t + 1) / width);
      s.shares[t].state.store(front | back << 32, std::memory_order_relaxed);
    }
    s.next.store(0, std::memory_order_relaxed);
    s.done.store(0, std::memory_order_relaxed);
    s.tickets.store(1, std::memory_order_relaxed);   // the caller is participant 0
    s.failed.store(false, std::memory_order_relaxed);
    s.error = nullptr;
    if (width != width_.load(std::memory_order_relaxed)) {
      width_.store(width, std::memory_order_seq_cst);
      futex_wake_all(&width_);
    }
    s.entry.store(static_cast<uint64_t>(gen) << 32 | OPEN, std::memory_order_seq_cst);
    epoch_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&epoch_);
    work(s, 0);
    wait_done(s);
    s.entry.fetch_and(~OPEN, std::memory_order_seq_cst);
    if (s.error) std::rethrow_exception(s.error);
  }

 private:
  std::mutex owner_mu_;                 // one region at a time
  std::mutex grow_mu_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};      // the newest region's gen (workers sleep on it)
  std::atomic<uint32_t> width_{0};      // participants of the newest region (workers past it sleep on it)
  std::atomic<int> sleepers_{0};
  Slot slots_[2];
  std::mt19937_64 rng_{12345};

  void grow(int num_workers) {
    if (static_cast<int>(workers_.size()) >= num_workers) return;
    std::lock_guard<std::mutex> lock(grow_mu_);
    while (static_cast<int>(workers_.size()) < num_workers) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, index] { worker(index); });
      workers_.back().detach();   // the pool lives as long as the process
    }
  }

  // the next piece participant `me` runs, or -1 when none is left
  static int64_t claim(Slot& s, int me) {
    const Job& job = s.job;
    if (job.shares == 0) {
      const int64_t k = s.next.fetch_add(1, std::memory_order_relaxed);
      if (k >= job.n) return -1;
      return job.order.empty() ? k : job.order[k];
    }
    auto take = [&](int t, bool own) -> int64_t {
      uint64_t st = s.shares[t].state.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t front = st & 0xffffffffu, back = st >> 32;
        if (front >= back) return -1;
        const uint64_t next = own ? (front + 1) | back << 32 : front | (back - 1) << 32;
        if (s.shares[t].state.compare_exchange_weak(st, next, std::memory_order_relaxed))
          return static_cast<int64_t>(own ? front : back - 1);
      }
    };
    if (me < job.shares) {
      const int64_t i = take(me, true);
      if (i >= 0) return i;
    }
    for (int d = 1; d <= job.shares; ++d) {
      const int t = (me + d) % job.shares;
      if (t == me) continue;
      const int64_t i = take(t, false);
      if (i >= 0) return i;
    }
    return -1;
  }

  // run pieces of slot s's region until none is left
  static void work(Slot& s, int me) {
    slot = me;
    for (int64_t i; (i = claim(s, me)) >= 0;) {
      if (!s.failed.load(std::memory_order_relaxed)) {
        try {
          s.job.call(s.job.ctx, i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(s.error_mu);
          if (!s.error) s.error = std::current_exception();
          s.failed.store(true, std::memory_order_relaxed);
        }
      }
      const uint32_t d = s.done.fetch_add(1, std::memory_order_seq_cst) + 1;
      if (d == static_cast<uint32_t>(s.job.n) && me != 0 && s.caller_asleep.load(std::memory_order_seq_cst))
        futex_wake_all(&s.done);
    }
    slot = -1;
  }

  static void wait_done(Slot& s) {
    const uint32_t n = static_cast<uint32_t>(s.job.n);
    const int64_t until = now_ns() + SPIN_DONE_NS;
    while (s.done.load(std::memory_order_acquire) != n) {
      if (now_ns() < until) {
        relax();
        continue;
      }
      s.caller_asleep.store(1, std::memory_order_seq_cst);
      const uint32_t d = s.done.load(std::memory_order_seq_cst);
      if (d != n) futex_wait(&s.done, d);
      s.caller_asleep.store(0, std::memory_order_relaxed);
    }
  }

  // enter the region of `gen` (still claimable), run pieces, leave
  void join(uint32_t gen) {
    Slot& s = slots_[gen & 1];
    uint64_t e = s.entry.load(std::memory_order_acquire);
    do {
      if ((e >> 32) != gen || !(e & OPEN)) return;
    } while (!s.entry.compare_exchange_weak(e, e + 1, std::memory_order_seq_cst));
    const int me = s.tickets.fetch_add(1, std::memory_order_relaxed);
    work(s, me);
    s.entry.fetch_sub(1, std::memory_order_release);
  }

  [[noreturn]] void worker(int index) {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t w = width_.load(std::memory_order_seq_cst);
      if (static_cast<uint32_t>(index) >= w) {   // not wanted at this width: asleep until it changes
        futex_wait(&width_, w);
        continue;
      }
      const uint32_t gen = epoch_.load(std::memory_order_acquire);
      if (gen != seen) {
        seen = gen;
        if (const int64_t delay = worker_delay_us.load(std::memory_order_relaxed))
          std::this_thread::sleep_for(std::chrono::microseconds(delay));
        join(gen);
        continue;
      }
      const int64_t until = now_ns() + SPIN_IDLE_NS;
      while (epoch_.load(std::memory_order_relaxed) == seen && now_ns() < until) relax();
      if (epoch_.load(std::memory_order_acquire) != seen) continue;
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch_, seen);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};

// The process's pool; a forked child starts a fresh one (the parent's workers do not exist there).
inline Pool*& pool_ptr() {
  static Pool* p = [] {
#if defined(__linux__)
    pthread_atfork(nullptr, nullptr, [] { pool_ptr() = new Pool; });
#endif
    return new Pool;
  }();
  return p;
}
inline Pool& pool() { return *pool_ptr(); }

}  // namespace lmi_pool
