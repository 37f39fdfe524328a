// A mutex, a scoped lock and a condition variable that Clang's thread-safety analysis
// understands (-Wthread-safety), plus the attribute macros to annotate what they guard.
//
// libstdc++'s std::mutex carries no capability attributes, so the analysis cannot follow it;
// these thin wrappers add them and nothing else (no extra state, no extra locking). Under
// compilers without the attributes (GCC) the macros expand to nothing.
//
//   mutable Mutex mu_;
//   int count_ KVT_GUARDED_BY(mu_);
//   void BumpLocked() KVT_REQUIRES(mu_);
//   void Bump() KVT_EXCLUDES(mu_) { MutexLock lock(mu_); BumpLocked(); }
//
// Thread safety: Mutex and CondVar are safe to use from any thread, as their std counterparts.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define KVT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVT_THREAD_ANNOTATION(x)
#endif

#define KVT_CAPABILITY(x) KVT_THREAD_ANNOTATION(capability(x))
#define KVT_SCOPED_CAPABILITY KVT_THREAD_ANNOTATION(scoped_lockable)
#define KVT_GUARDED_BY(x) KVT_THREAD_ANNOTATION(guarded_by(x))
#define KVT_PT_GUARDED_BY(x) KVT_THREAD_ANNOTATION(pt_guarded_by(x))
#define KVT_REQUIRES(...) KVT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define KVT_EXCLUDES(...) KVT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define KVT_ACQUIRE(...) KVT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define KVT_RELEASE(...) KVT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define KVT_RETURN_CAPABILITY(x) KVT_THREAD_ANNOTATION(lock_returned(x))
#define KVT_NO_THREAD_SAFETY_ANALYSIS KVT_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace kvt {

class KVT_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() KVT_ACQUIRE() { mu_.lock(); }
  void Unlock() KVT_RELEASE() { mu_.unlock(); }
  // For code that needs the std type (CondVar); the analysis does not see through it.
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

// Holds `mu` for its scope. Unlock()/Lock() let a scope drop the lock around blocking work.
class KVT_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) KVT_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() KVT_RELEASE() {
    if (held_) mu_.Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() KVT_RELEASE() {
    held_ = false;
    mu_.Unlock();
  }
  void Lock() KVT_ACQUIRE() {
    mu_.Lock();
    held_ = true;
  }

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A condition variable waited on with a Mutex held (the wait releases and re-acquires it, as
// std::condition_variable does).
class CondVar {
 public:
  void Wait(Mutex& mu) KVT_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.native(), std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // False when `deadline` passed (the caller re-checks its predicate either way).
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex& mu, std::chrono::time_point<Clock, Duration> deadline) KVT_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.native(), std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  void NotifyAll() { cv_.notify_all(); }
  void NotifyOne() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvt
