// A small persistent thread pool: run(n, f) calls f(0..n-1) once each, on the caller and the
// workers. Tasks are claimed from a shared counter, so a worker the OS has not scheduled yet
// (a busy machine) delays nothing: the caller takes the tasks it has not claimed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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
  void work();
  void claim(uint64_t job);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, wake_mutex_;
  std::condition_variable wake_;
  // ticket: job number (high 32 bits) and the next task index (low 32): a worker claims a task
  // only of the job it saw, by compare-and-swap, so none runs a task of a later job by mistake
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> finished_{0};
  std::atomic<bool> stop_{false};
  int tasks_ = 0;
  const std::function<void(int)>* job_ = nullptr;
};

} // namespace vqpipe
