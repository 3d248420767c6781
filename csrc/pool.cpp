#include "pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define VQ_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define VQ_PAUSE() asm volatile("yield")
#else
#define VQ_PAUSE() ((void)0)
#endif

namespace vqpipe {

namespace {
constexpr int kSpin = 20000; // pause loops (~0.1-0.5 ms) before an idle worker sleeps
constexpr int kMaxThreads = 16;
constexpr uint64_t kClosed = 0xffffffffu; // task index while a job is being set up: claims nothing
} // namespace

Pool& Pool::get() {
  static Pool pool(std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxThreads));
  return pool;
}

Pool::Pool(int threads) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { work(); });
  }
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_ = true;
    ticket_.fetch_add(uint64_t{1} << 32);
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

// Run tasks of job `job` (the ticket's high half) until none is left.
void Pool::claim(uint64_t job) {
  uint64_t t = ticket_.load(std::memory_order_acquire);
  while ((t >> 32) == job) {
    if ((t & 0xffffffffu) == kClosed) { // the job's arguments are being written: wait for them
      VQ_PAUSE();
      t = ticket_.load(std::memory_order_acquire);
      continue;
    }
    const int i = static_cast<int>(t & 0xffffffffu);
    if (i >= tasks_) {
      return;
    }
    if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
      (*job_)(i);
      finished_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }
}

void Pool::work() {
  uint64_t seen = 0;
  while (true) {
    int spins = 0;
    while ((ticket_.load(std::memory_order_acquire) >> 32) == seen && spins < kSpin) {
      VQ_PAUSE();
      ++spins;
    }
    if ((ticket_.load(std::memory_order_acquire) >> 32) == seen) {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_.wait(lock, [&] { return (ticket_.load() >> 32) != seen; });
    }
    if (stop_) {
      return;
    }
    seen = ticket_.load(std::memory_order_acquire) >> 32;
    claim(seen);
  }
}

void Pool::run(int n, const std::function<void(int)>& f) {
  // One job at a time; a second caller (another stream's thread) runs its tasks itself.
  std::unique_lock<std::mutex> lock(run_mutex_, std::try_to_lock);
  if (n <= 1 || workers_.empty() || !lock.owns_lock()) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  // A new job number first, closed: a worker still holding the last job's ticket fails its
  // compare-and-swap, so it cannot take a task index while job_ and tasks_ change.
  const uint64_t job = (ticket_.load() >> 32) + 1;
  ticket_.store((job << 32) | kClosed, std::memory_order_seq_cst);
  job_ = &f;
  tasks_ = n;
  finished_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> wake_lock(wake_mutex_);
    ticket_.store(job << 32, std::memory_order_release);
  }
  wake_.notify_all();
  claim(job);
  // only tasks a worker claimed are left: wait for those
  while (finished_.load(std::memory_order_acquire) < n) {
    VQ_PAUSE();
  }
}

} // namespace vqpipe
