// A small persistent thread pool: run(n, f) calls f(0..n-1), task i on thread i (the caller is 0;
// n <= size()). Every worker acknowledges every job, so none can lag into the next one.
// Workers spin briefly before sleeping: a decode step makes ~100 calls of a few hundred
// microseconds each, and a condition-variable wake-up per call would cost a noticeable share.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vqpipe {

class Pool {
 public:
  static Pool& get();
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  void run(int n, const std::function<void(int)>& f);
  ~Pool();

 private:
  explicit Pool(int threads);
  void work(int index);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, wake_mutex_;
  std::condition_variable wake_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  int tasks_ = 0;
  const std::function<void(int)>* job_ = nullptr;
};

} // namespace vqpipe
