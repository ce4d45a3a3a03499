// The CPU decode step's threads: `parallel`, the decode loops' at::parallel_for (included by cpu_decode.cpp;
// kernels/cpu_decode.py builds them together).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// A decoded token runs about 150 parallel loops of 10-100 us each. Under the app's sleeping
// OpenMP wait (OMP_WAIT_POLICY=PASSIVE, localchat/__init__.py) OpenMP puts its other threads to sleep after each
// loop and wakes them for the next: a futex and a core's wake-up, twice a loop. This pool's threads spin for the
// next loop (or for the others' shares) for a short window first, then sleep on a futex as OpenMP's would; the
// window adapts (wait_for). On the 2-core EPYC a step at 1,182 units took 16.3 ms against 19.8 with OpenMP, the
// same bits, and as long as OpenMP's beside busy processes (bench/results/cpu-defaults-avx2/pool_ab.txt).
// Linux only; elsewhere, and with set_pool(0), the loops take at::parallel_for.
#if defined(__linux__)
int64_t spin_us = 200;
#else
int64_t spin_us = 0;
#endif

void set_pool(int64_t us) { spin_us = us; }

namespace {

using Loop = std::function<void(int64_t, int64_t)>;

#if defined(__linux__)
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op | FUTEX_PRIVATE_FLAG, value, nullptr, nullptr, 0);
}

// Until `done()`: spin for up to this thread's window, then sleep on `word` while it holds what `value()` reads
// (whoever changes it wakes `word`'s sleepers when `asleep` says there are some). A wait the spin ended doubles
// the window (up to spin_us), one that had to sleep halves it: where the other thread keeps being preempted (a
// busy machine) the spins shrink to nothing and the pool sleeps as OpenMP's would. No sched_yield: the kernel's
// EEVDF scheduler pushes a yielding thread's deadline back a slice per call, which starves it under load.
template <class Done, class Value>
void wait_for(Done done, Value value, std::atomic<uint32_t>* word, std::atomic<uint32_t>& asleep) {
  thread_local double window = -1;  // microseconds; a new thread starts at spin_us
  thread_local int64_t waits = 0;
  window = window < 0 ? spin_us : std::min(window, static_cast<double>(spin_us));
  if (done()) return;
  // every 32nd wait spins the whole spin_us: a window that shrank under load grows back once the load is gone
  const bool probe = ++waits % 32 == 0;
  const double spin = probe ? static_cast<double>(spin_us) : window;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(1000 * spin));
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 16; ++i) {
      if (done()) {
        window = probe ? spin_us : std::min(static_cast<double>(spin_us), 2 * window + 1);
        return;
      }
      relax();
    }
  }
  window /= 2;
  while (!done()) {
    asleep.fetch_add(1);
    const uint32_t seen = value();
    if (!done()) futex(word, FUTEX_WAIT, seen);
    asleep.fetch_sub(1);
  }
}

struct Pool {
  int64_t threads;
  std::atomic<uint32_t> job{0}, left{0}, workers_asleep{0}, caller_asleep{0};
  std::atomic<bool> stop{false};
  std::mutex busy;  // one loop at a time; a second caller takes at::parallel_for
  const Loop* loop = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  std::exception_ptr error;
  std::mutex error_lock;

  explicit Pool(int64_t n) : threads(n) {
    for (int64_t t = 1; t < n; ++t) std::thread([this, t] { work(t); }).detach();
  }

  void share(int64_t t) {
    const int64_t b = begin + t * chunk, e = std::min(end, b + chunk);
    if (b >= e) return;
    try {
      (*loop)(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> hold(error_lock);
      if (!error) error = std::current_exception();
    }
  }

  void work(int64_t t) {
    uint32_t seen = 0;
    for (;;) {
      wait_for([&] { return job.load() != seen; }, [&] { return seen; }, &job, workers_asleep);
      seen = job.load();
      if (stop.load()) return;
      share(t);
      if (left.fetch_sub(1) == 1 && caller_asleep.load()) futex(&left, FUTEX_WAKE, 1);
    }
  }

  // `f` over [b, e) in shares of at least `grain` (at::parallel_for's split), the caller taking the first share.
  void run(int64_t b, int64_t e, int64_t grain, const Loop& f) {
    const int64_t n = std::min(threads, (e - b + grain - 1) / grain);
    loop = &f;
    begin = b;
    end = e;
    chunk = (e - b + n - 1) / n;
    error = nullptr;
    left.store(static_cast<uint32_t>(threads - 1));
    job.fetch_add(1);
    if (workers_asleep.load()) futex(&job, FUTEX_WAKE, INT32_MAX);
    share(0);
    wait_for([&] { return left.load() == 0; }, [&] { return left.load(); }, &left, caller_asleep);
    if (error) std::rethrow_exception(error);
  }
};

Pool* pool = nullptr;  // made on first use; a new one when torch's thread count changes (the old one is left)
bool in_child = false;  // after fork() the workers are gone: the child makes its own pool

void parallel(int64_t b, int64_t e, int64_t grain, const Loop& f) {
  if (b >= e) return;
  const int64_t threads = at::get_num_threads();
  if (spin_us <= 0 || threads < 2 || e - b <= grain || at::in_parallel_region()) return at::parallel_for(b, e, grain, f);
  static std::mutex make;
  Pool* p;
  {
    std::lock_guard<std::mutex> hold(make);
    if (in_child) {
      pool = nullptr;
      in_child = false;
    }
    if (pool == nullptr || pool->threads != threads) {
      if (pool != nullptr) {  // the old one's workers leave once its loop in flight, if any, is done
        std::lock_guard<std::mutex> idle(pool->busy);
        pool->stop.store(true);
        pool->job.fetch_add(1);
        futex(&pool->job, FUTEX_WAKE, INT32_MAX);
      }
      static bool hooked = false;
      if (!hooked) hooked = pthread_atfork(nullptr, nullptr, [] { in_child = true; }) == 0;
      pool = new Pool(threads);
    }
    p = pool;
  }
  std::unique_lock<std::mutex> hold(p->busy, std::try_to_lock);
  if (!hold.owns_lock() || p->stop.load()) return at::parallel_for(b, e, grain, f);  // busy, or replaced meanwhile
  p->run(b, e, grain, f);
}
#else
void parallel(int64_t b, int64_t e, int64_t grain, const Loop& f) { at::parallel_for(b, e, grain, f); }
#endif

}  // namespace
