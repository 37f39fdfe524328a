// StreamCopyRuns (the ucx backend's copy of a direct write): byte exactness at every size and
// alignment that matters to the non-temporal path (head to the next destination line, whole
// lines, tail), runs across several buffers, the stop flag, and no access past a run's end
// (sources and destinations that end at a guard page); SplitRuns (slices for the copy threads).
#include "backends/common/stream_copy.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace kvt::transfer {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(StreamCopyTest, EverySizeAndAlignmentIsByteExact) {
  constexpr size_t kBytes = 1 << 20;
  const std::vector<uint8_t> src = RandomBytes(kBytes, 1);
  const uint64_t sizes[] = {0, 1, 15, 63, 64, 65, 127, 255, 256, 257, 1000, 4096, 4097, 32768 + 13};
  for (uint64_t size : sizes) {
    for (uint64_t src_off : {0, 1, 8, 17, 64}) {
      for (uint64_t dst_off : {0, 1, 16, 33, 63}) {
        std::vector<uint8_t> dst(kBytes, 0xEE);
        const CopyRun run{0, src_off, dst_off + 4096, size};
        const uint8_t* s[] = {src.data()};
        uint8_t* d[] = {dst.data()};
        ASSERT_EQ(StreamCopyRuns({&run, 1}, s, d), 1u);
        ASSERT_EQ(std::memcmp(dst.data() + run.dst_offset, src.data() + src_off, size), 0)
            << "size " << size << " src+" << src_off << " dst+" << dst_off;
        // Nothing outside the run changed.
        for (uint64_t i = 0; i < kBytes; ++i) {
          if (i >= run.dst_offset && i < run.dst_offset + size) continue;
          ASSERT_EQ(dst[i], 0xEE) << "byte " << i << " outside the run (size " << size << ")";
        }
      }
    }
  }
}

TEST(StreamCopyTest, ManyRunsAcrossBuffersMatchMemcpy) {
  constexpr int kBuffers = 4;
  constexpr uint64_t kItem = 32768;
  constexpr uint64_t kPages = 64;
  std::vector<std::vector<uint8_t>> src, dst, want;
  for (int b = 0; b < kBuffers; ++b) {
    src.push_back(RandomBytes(kItem * kPages, 10 + b));
    dst.emplace_back(kItem * kPages, 0);
    want.emplace_back(kItem * kPages, 0);
  }
  // Random pages both sides, sizes from 2 KiB pieces to whole items, several below the
  // prefetch distance so the prefetch cursor crosses many runs.
  std::mt19937 rng(7);
  std::vector<uint64_t> src_pages(kPages), dst_pages(kPages);
  for (uint64_t i = 0; i < kPages; ++i) src_pages[i] = dst_pages[i] = i;
  std::shuffle(src_pages.begin(), src_pages.end(), rng);
  std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
  std::vector<CopyRun> runs;
  for (uint32_t b = 0; b < kBuffers; ++b) {
    for (uint64_t i = 0; i < kPages; ++i) {
      const uint64_t bytes = (i % 3 == 0) ? kItem : (i % 3 == 1 ? 2048 : 2048 + 40);
      // Pieces start a few bytes into their page (unaligned destinations); a whole item has no
      // room to shift, or the last page's run would end past the buffer.
      const uint64_t shift = bytes < kItem ? i % 5 : 0;
      runs.push_back({b, src_pages[i] * kItem, dst_pages[i] * kItem + shift, bytes});
    }
  }
  std::vector<const uint8_t*> s;
  std::vector<uint8_t*> d;
  for (int b = 0; b < kBuffers; ++b) {
    s.push_back(src[b].data());
    d.push_back(dst[b].data());
  }
  ASSERT_EQ(StreamCopyRuns(runs, s, d), runs.size());
  for (const CopyRun& r : runs) {
    std::memcpy(want[r.buffer].data() + r.dst_offset, src[r.buffer].data() + r.src_offset, r.bytes);
  }
  for (int b = 0; b < kBuffers; ++b) EXPECT_EQ(dst[b], want[b]) << "buffer " << b;
}

TEST(StreamCopyTest, StopFlagSetBeforehandCopiesNothing) {
  std::vector<uint8_t> src = RandomBytes(1 << 16, 3), dst(1 << 16, 0xEE);
  const CopyRun runs[] = {{0, 0, 0, 4096}, {0, 4096, 4096, 4096}};
  const uint8_t* s[] = {src.data()};
  uint8_t* d[] = {dst.data()};
  std::atomic<bool> stop{true};
  EXPECT_EQ(StreamCopyRuns(runs, s, d, &stop), 0u);
  for (uint8_t b : dst) ASSERT_EQ(b, 0xEE);
  stop = false;
  EXPECT_EQ(StreamCopyRuns(runs, s, d, &stop), 2u);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 8192), 0);
}

// Runs that end exactly where a mapping ends (a PROT_NONE page after it): neither the copy nor
// its prefetch may fault.
TEST(StreamCopyTest, RunsEndingAtAGuardPageDoNotFault) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 16 * page;
  auto map = [&] {
    void* p =
        mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    EXPECT_EQ(mprotect(static_cast<uint8_t*>(p) + bytes, page, PROT_NONE), 0);
    return static_cast<uint8_t*>(p);
  };
  uint8_t* src = map();
  uint8_t* dst = map();
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  // The last run ends at the guard page on both sides; the cursor's prefetch of the run after
  // it (there is none) and of the lines past it must not touch the guard page either.
  const CopyRun runs[] = {{0, 0, page, 3 * page + 5}, {0, bytes - 5000, bytes - 5000, 5000}};
  const uint8_t* s[] = {src};
  uint8_t* d[] = {dst};
  EXPECT_EQ(StreamCopyRuns(runs, s, d), 2u);
  EXPECT_EQ(std::memcmp(dst + page, src, 3 * page + 5), 0);
  EXPECT_EQ(std::memcmp(dst + bytes - 5000, src + bytes - 5000, 5000), 0);
  munmap(src, bytes + page);
  munmap(dst, bytes + page);
}

// Every (buffer, byte) a list of runs moves, as (buffer, src byte) -> dst byte pairs in order.
std::vector<std::array<uint64_t, 3>> BytesMoved(const std::vector<CopyRun>& runs) {
  std::vector<std::array<uint64_t, 3>> out;
  for (const CopyRun& r : runs) {
    for (uint64_t i = 0; i < r.bytes; i += 512) {
      out.push_back({r.buffer, r.src_offset + i, r.dst_offset + i});
    }
  }
  return out;
}

TEST(SplitRunsTest, SmallWritesStayOneSlice) {
  std::vector<CopyRun> runs{{0, 0, 0, 4096}, {1, 8192, 0, 4096}};
  const std::vector<CopyRun> before = runs;
  EXPECT_EQ(SplitRuns(runs, 4, 1 << 20), (std::vector<size_t>{0, 2}));
  EXPECT_EQ(runs, before);
  EXPECT_EQ(SplitRuns(runs, 1, 1), (std::vector<size_t>{0, 2}));
  std::vector<CopyRun> none;
  EXPECT_EQ(SplitRuns(none, 4, 1), (std::vector<size_t>{0, 0}));
}

TEST(SplitRunsTest, OneLongRunIsCutAtFourKibMultiples) {
  std::vector<CopyRun> runs{{3, 100, 200, (uint64_t{8} << 20) + 5}};
  const auto moved = BytesMoved(runs);
  const std::vector<size_t> bounds = SplitRuns(runs, 3, 1 << 20);
  ASSERT_EQ(bounds.size(), 4u);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(bounds, (std::vector<size_t>{0, 1, 2, 3}));
  for (size_t i = 0; i + 1 < runs.size(); ++i) EXPECT_EQ(runs[i].bytes % 4096, 0u) << i;
  EXPECT_EQ(BytesMoved(runs), moved);  // same bytes, same order
}

TEST(SplitRunsTest, ManyRunsGetBalancedSlicesCoveringEveryByte) {
  std::mt19937 rng(5);
  for (int parts : {2, 3, 4, 7}) {
    std::vector<CopyRun> runs;
    uint64_t total = 0;
    for (uint32_t i = 0; i < 300; ++i) {
      const uint64_t bytes = 1024 + rng() % (64 * 1024);
      runs.push_back({i % 8, uint64_t{i} << 20, (uint64_t{i} << 20) + 64, bytes});
      total += bytes;
    }
    const auto moved = BytesMoved(runs);
    const std::vector<size_t> bounds = SplitRuns(runs, parts, 1 << 20);
    const uint64_t slices = std::min<uint64_t>(parts, total >> 20);
    ASSERT_EQ(bounds.size(), slices + 1) << parts;
    EXPECT_EQ(bounds.front(), 0u);
    EXPECT_EQ(bounds.back(), runs.size());
    const uint64_t target = (total + slices - 1) / slices;
    for (size_t s = 0; s + 1 < bounds.size(); ++s) {
      ASSERT_LT(bounds[s], bounds[s + 1]) << "empty slice " << s;
      uint64_t bytes = 0;
      for (size_t i = bounds[s]; i < bounds[s + 1]; ++i) bytes += runs[i].bytes;
      EXPECT_LE(bytes, target + 4096) << "slice " << s << " of " << parts;
      if (s + 2 < bounds.size()) {
        EXPECT_GE(bytes, target) << "slice " << s << " of " << parts;
      }
    }
    EXPECT_EQ(BytesMoved(runs), moved) << parts;
  }
}

}  // namespace
}  // namespace kvt::transfer
