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
constexpr int kSpin = 20000; // pause loops (~0.1-0.5 ms) before a worker sleeps
constexpr int kMaxThreads = 16;
} // namespace

Pool& Pool::get() {
  static Pool pool(std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxThreads));
  return pool;
}

Pool::Pool(int threads) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i] { work(i); });
  }
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void Pool::work(int index) {
  unsigned seen = 0;
  while (true) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kSpin) {
      VQ_PAUSE();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) {
      return;
    }
    if (index < tasks_) {
      (*job_)(index);
    }
    done_.fetch_add(1, std::memory_order_release);
  }
}

void Pool::run(int n, const std::function<void(int)>& f) {
  // One job at a time; a second caller (another stream's thread) runs its tasks itself.
  std::unique_lock<std::mutex> lock(run_mutex_, std::try_to_lock);
  if (n <= 1 || n > size() || workers_.empty() || !lock.owns_lock()) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  job_ = &f;
  tasks_ = n;
  done_.store(0);
  {
    std::lock_guard<std::mutex> wake_lock(wake_mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  f(0);
  const int workers = static_cast<int>(workers_.size());
  while (done_.load(std::memory_order_acquire) < workers) {
    VQ_PAUSE();
  }
}

} // namespace vqpipe
