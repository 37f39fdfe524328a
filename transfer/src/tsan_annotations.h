// Happens-before edges that ThreadSanitizer cannot see (private to the transfer library): a
// hand-over through memory it does not track as one object (UCX's uninstrumented internals, one
// shared-memory segment mapped twice in one process) is reported on an address of this
// process instead. No-ops in other builds.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define KVT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVT_TSAN 1
#endif
#endif

#ifdef KVT_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvt::transfer::internal {

// What this thread did so far happens before what a thread does after TsanAcquire(tag).
inline void TsanRelease([[maybe_unused]] void* tag) {
#ifdef KVT_TSAN
  __tsan_release(tag);
#endif
}

inline void TsanAcquire([[maybe_unused]] void* tag) {
#ifdef KVT_TSAN
  __tsan_acquire(tag);
#endif
}

}  // namespace kvt::transfer::internal
