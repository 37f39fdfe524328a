// GPU tests of cuda::CompletionWord (label gpu; each skips itself without a CUDA device): the
// word stays behind work that has not run, reaches each signal's value once the work before it
// has completed, and shows what a kernel before the signal wrote.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "kvt/kernels/cuda_util.h"
#include "kvt/testing/gpu.h"
#include "kvt/testing/status.h"

namespace kvt::cuda {
namespace {

using Clock = std::chrono::steady_clock;

// Holds a stream behind a host function until `open` (or 15 s, so nothing hangs).
void CUDART_CB HoldUntilOpen(void* flag) {  // a CUDA thread: no CUDA calls here
  const auto give_up = Clock::now() + std::chrono::seconds(15);
  auto* open = static_cast<std::atomic<bool>*>(flag);
  while (!open->load() && Clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Spins until the word reaches `value` (true) or 10 s passed (false).
bool Reaches(const CompletionWord& word, uint64_t value) {
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (word.Load() < value) {
    if (Clock::now() > give_up) return false;
  }
  return true;
}

TEST(CompletionWordGpuTest, FollowsTheStreamAndNeverRunsAhead) {
  KVT_SKIP_WITHOUT_GPU();
  KVT_ASSERT_OK(ToStatus(cudaSetDevice(0), "cudaSetDevice"));
  auto word = CompletionWord::Create(0);
  ASSERT_TRUE(word.ok()) << word.status();
  EXPECT_TRUE(word->valid());
  EXPECT_EQ(word->Load(), 0u) << "a new word starts at 0";
  auto stream = Stream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();

  std::atomic<bool> open{false};
  KVT_ASSERT_OK(
      ToStatus(cudaLaunchHostFunc(stream->get(), &HoldUntilOpen, &open), "cudaLaunchHostFunc"));
  KVT_ASSERT_OK(word->Signal(stream->get(), 7));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const uint64_t while_held = word->Load();
  open.store(true);
  EXPECT_EQ(while_held, 0u) << "the word was set before the work ahead of it ran";
  EXPECT_TRUE(Reaches(*word, 7));
  EXPECT_EQ(word->Load(), 7u);

  // Signals of growing values, each behind a kernel: once the word shows a value, the bytes the
  // kernel before that signal copied are in place.
  constexpr size_t kBytes = size_t{4} << 20;
  auto src = DeviceBuffer::Allocate(kBytes, 0);
  auto dst = DeviceBuffer::Allocate(kBytes, 0);
  auto back = PinnedBuffer::Allocate(kBytes);
  ASSERT_TRUE(src.ok() && dst.ok() && back.ok());
  for (uint64_t round = 1; round <= 20; ++round) {
    const int fill = static_cast<int>(round);
    KVT_ASSERT_OK(ToStatus(cudaMemsetAsync(src->data(), fill, kBytes, stream->get()), "memset"));
    KVT_ASSERT_OK(ToStatus(
        cudaMemcpyAsync(dst->data(), src->data(), kBytes, cudaMemcpyDeviceToDevice, stream->get()),
        "cudaMemcpyAsync"));
    KVT_ASSERT_OK(word->Signal(stream->get(), 7 + round));
    ASSERT_TRUE(Reaches(*word, 7 + round)) << "round " << round;
    // Read on another stream, which does not wait for the first: only the word says it is done.
    auto reader = Stream::Create(0);
    ASSERT_TRUE(reader.ok());
    KVT_ASSERT_OK(ToStatus(
        cudaMemcpyAsync(back->data(), dst->data(), kBytes, cudaMemcpyDeviceToHost, reader->get()),
        "cudaMemcpyAsync back"));
    KVT_ASSERT_OK(reader->Synchronize());
    const auto* bytes = back->as<uint8_t>();
    size_t wrong = 0;
    for (size_t i = 0; i < kBytes; ++i) wrong += bytes[i] != static_cast<uint8_t>(fill);
    ASSERT_EQ(wrong, 0u) << "round " << round << ": bytes of the copy before the signal missing";
  }
  KVT_ASSERT_OK(stream->Synchronize());
}

}  // namespace
}  // namespace kvt::cuda
