// The shared-memory lane's rings: bytes arrive in order across the wrap, a full ring takes what
// fits, a segment that is not the one offered is refused, corrupted indices fail with DataLoss,
// and the sleep flag never loses a doorbell. The two ends are two mappings in one process, as
// they would be in two processes.
#include "control/lane.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace kvt::control::internal {
namespace {

using ::testing::HasSubstr;

struct Pair {
  std::unique_ptr<Lane> creator, opener;
};

Pair MakePair(uint32_t ring_bytes) {
  Pair p;
  auto created = Lane::Create(ring_bytes);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return p;
  p.creator = std::move(created).value();
  auto opened = Lane::Open(p.creator->name(), p.creator->nonce(), ring_bytes);
  EXPECT_TRUE(opened.ok()) << opened.status();
  if (opened.ok()) p.opener = std::move(opened).value();
  return p;
}

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return s;
}

TEST(LaneTest, BytesArriveInOrderBothWaysAcrossTheWrap) {
  Pair p = MakePair(kMinLaneRingBytes);
  ASSERT_TRUE(p.creator && p.opener);
  EXPECT_EQ(p.creator->name().rfind("/kvt-lane-", 0), 0u);
  // The opener removed the name: nobody else can open it now.
  EXPECT_EQ(::shm_open(p.creator->name().c_str(), O_RDWR, 0), -1);
  std::string sent, received;
  std::vector<char> buf(kMinLaneRingBytes);
  for (int round = 0; round < 20; ++round) {  // 20 x 1500 bytes: the 4 KiB ring wraps often
    const std::string chunk = Pattern(1500, round);
    auto n = p.creator->Write(chunk);
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_EQ(*n, chunk.size());
    sent += chunk;
    EXPECT_TRUE(p.opener->Readable());
    auto r = p.opener->Read(buf.data(), buf.size());
    ASSERT_TRUE(r.ok()) << r.status();
    received.append(buf.data(), *r);
    EXPECT_FALSE(p.opener->Readable());
    // The other direction.
    auto back = p.opener->Write(chunk.substr(0, 100 + round));
    ASSERT_TRUE(back.ok());
    auto got = p.creator->Read(buf.data(), buf.size());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::string(buf.data(), *got), chunk.substr(0, 100 + round));
  }
  EXPECT_EQ(received, sent);
}

TEST(LaneTest, AFullRingTakesWhatFitsAndTheRestAfterARead) {
  Pair p = MakePair(kMinLaneRingBytes);
  ASSERT_TRUE(p.creator && p.opener);
  const std::string big = Pattern(3 * kMinLaneRingBytes, 3);
  auto n = p.creator->Write(big);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, kMinLaneRingBytes);
  auto none = p.creator->Write(big.substr(*n));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
  std::vector<char> buf(1000);
  auto r = p.opener->Read(buf.data(), buf.size());  // a partial read frees 1000 bytes
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 1000u);
  auto more = p.creator->Write(big.substr(*n));
  ASSERT_TRUE(more.ok());
  EXPECT_EQ(*more, 1000u);
  std::string received(buf.data(), 1000);
  std::vector<char> rest(2 * kMinLaneRingBytes);
  auto r2 = p.opener->Read(rest.data(), rest.size());
  ASSERT_TRUE(r2.ok());
  received.append(rest.data(), *r2);
  EXPECT_EQ(received, big.substr(0, kMinLaneRingBytes + 1000));
}

TEST(LaneTest, TwoThreadsStreamMegabytesExactly) {
  Pair p = MakePair(kMinLaneRingBytes);
  ASSERT_TRUE(p.creator && p.opener);
  const std::string data = Pattern(8 << 20, 9);
  std::thread writer([&] {
    size_t at = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (at < data.size() && std::chrono::steady_clock::now() < until) {
      auto n = p.creator->Write(std::string_view(data).substr(at, 777));
      ASSERT_TRUE(n.ok()) << n.status();
      at += *n;
      if (*n == 0) std::this_thread::yield();
    }
  });
  std::string received;
  received.reserve(data.size());
  std::vector<char> buf(3000);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (received.size() < data.size() && std::chrono::steady_clock::now() < until) {
    auto r = p.opener->Read(buf.data(), buf.size());
    ASSERT_TRUE(r.ok()) << r.status();
    received.append(buf.data(), *r);
    if (*r == 0) std::this_thread::yield();
  }
  writer.join();
  EXPECT_TRUE(received == data) << "received " << received.size() << " of " << data.size();
}

// A second raw mapping of the segment plays the hostile or broken peer.
TEST(LaneTest, CorruptedIndicesFailWithDataLoss) {
  auto created = Lane::Create(kMinLaneRingBytes);
  ASSERT_TRUE(created.ok());
  Lane& creator = **created;
  // Map the segment a second time, as the hostile peer.
  const int fd = ::shm_open(creator.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  const size_t size = 64 + 2 * (192 + kMinLaneRingBytes);
  void* raw = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(raw, MAP_FAILED);
  auto* bytes = static_cast<char*>(raw);
  // Ring a (creator -> opener): head at +64, tail at +128. Ring b: after a's data.
  auto* a_head = reinterpret_cast<std::atomic<uint64_t>*>(bytes + 64);
  auto* b_tail =
      reinterpret_cast<std::atomic<uint64_t>*>(bytes + 64 + 192 + kMinLaneRingBytes + 64);
  a_head->store(1u << 30);  // the "reader" claims to have read more than was ever written
  auto w = creator.Write("hello");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(w.status().message(), HasSubstr("reader's index 1073741824 is impossible"));
  b_tail->store(kMinLaneRingBytes + 1);  // the "writer" published more than the ring holds
  std::vector<char> buf(64);
  auto r = creator.Read(buf.data(), buf.size());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("writer's index 4097 is impossible"));
  ::munmap(raw, size);
}

TEST(LaneTest, OnlyTheOfferedSegmentOpens) {
  auto created = Lane::Create(kMinLaneRingBytes);
  ASSERT_TRUE(created.ok());
  const Lane& lane = **created;
  auto wrong_nonce = Lane::Open(lane.name(), std::string(kLaneNonceBytes, 'x'), kMinLaneRingBytes);
  ASSERT_FALSE(wrong_nonce.ok());
  EXPECT_EQ(wrong_nonce.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong_nonce.status().message(), HasSubstr("nonce does not match"));
  auto wrong_size = Lane::Open(lane.name(), lane.nonce(), 2 * kMinLaneRingBytes);
  ASSERT_FALSE(wrong_size.ok());
  EXPECT_THAT(wrong_size.status().message(), HasSubstr("not the"));
  auto missing =
      Lane::Open("/kvt-lane-00000000000000000000000000000000", lane.nonce(), kMinLaneRingBytes);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("another host"));
  for (const std::string bad : {"/etc/passwd", "/kvt-lane-../../x", "kvt-lane-0",
                                "/kvt-lane-0000000000000000000000000000000G"}) {
    auto opened = Lane::Open(bad, lane.nonce(), kMinLaneRingBytes);
    ASSERT_FALSE(opened.ok()) << bad;
    EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(opened.status().message(), HasSubstr(bad));
  }
  auto bad_bytes = Lane::Create(3000);
  ASSERT_FALSE(bad_bytes.ok());
  EXPECT_THAT(bad_bytes.status().message(), HasSubstr("ring_bytes = 3000"));
  // The offered segment still opens after all of that.
  auto opened = Lane::Open(lane.name(), lane.nonce(), kMinLaneRingBytes);
  EXPECT_TRUE(opened.ok()) << opened.status();
}

// A segment others may open, or that another user owns, is refused before it is mapped: its
// owner could truncate it under the mapping.
TEST(LaneTest, OnlyAPrivateSegmentOfThisUserOpens) {
  auto created = Lane::Create(kMinLaneRingBytes);
  ASSERT_TRUE(created.ok());
  const Lane& lane = **created;
  const int fd = ::shm_open(lane.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchmod(fd, 0644), 0);
  auto shared = Lane::Open(lane.name(), lane.nonce(), kMinLaneRingBytes);
  ASSERT_FALSE(shared.ok());
  EXPECT_EQ(shared.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(shared.status().message(), HasSubstr("with mode 0644"));
  EXPECT_THAT(shared.status().message(), HasSubstr("keeps its socket"));
  ASSERT_EQ(::fchmod(fd, 0600), 0);
  if (::geteuid() == 0) {  // only root can give the segment to another user
    ASSERT_EQ(::fchown(fd, 65534, static_cast<gid_t>(-1)), 0);
    auto foreign = Lane::Open(lane.name(), lane.nonce(), kMinLaneRingBytes);
    ASSERT_FALSE(foreign.ok());
    EXPECT_THAT(foreign.status().message(), HasSubstr("belongs to uid 65534"));
    ASSERT_EQ(::fchown(fd, 0, static_cast<gid_t>(-1)), 0);
  }
  ::close(fd);
  auto opened = Lane::Open(lane.name(), lane.nonce(), kMinLaneRingBytes);
  EXPECT_TRUE(opened.ok()) << opened.status();
}

TEST(LaneTest, TheCreatorRemovesTheNameWhenItGoesAway) {
  std::string name;
  {
    auto created = Lane::Create(kMinLaneRingBytes);
    ASSERT_TRUE(created.ok());
    name = (*created)->name();
  }
  EXPECT_EQ(::shm_open(name.c_str(), O_RDWR, 0), -1);
}

// A lane file nobody removed (its creator died before the peer opened it) goes at the next
// Create once it is a minute old; a younger one, and files that are not lanes, stay.
TEST(LaneTest, CreateRemovesLaneFilesLeftForAMinute) {
  auto file = [](const std::string& name, time_t age_s) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0) return false;
    const timespec when[2] = {{::time(nullptr) - age_s, 0}, {::time(nullptr) - age_s, 0}};
    const bool ok = ::futimens(fd, when) == 0;
    ::close(fd);
    return ok;
  };
  auto exists = [](const std::string& name) {
    const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  };
  const std::string stale = "/kvt-lane-5ca1e5ca1e5ca1e5ca1e5ca1e5ca1e00";
  const std::string young = "/kvt-lane-5ca1e5ca1e5ca1e5ca1e5ca1e5ca1e01";
  const std::string other = "/kvt-lane-test-not-a-lane";
  ASSERT_TRUE(file(stale, 120));
  ASSERT_TRUE(file(young, 5));
  ASSERT_TRUE(file(other, 120));
  auto created = Lane::Create(kMinLaneRingBytes);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_FALSE(exists(stale));
  EXPECT_TRUE(exists(young));
  EXPECT_TRUE(exists(other));
  EXPECT_TRUE(exists((*created)->name()));
  ::shm_unlink(young.c_str());
  ::shm_unlink(other.c_str());
}

// Dekker on the sleep flag: for every byte written, either the sleeping reader sees it in
// Sleep() or the writer sees the reader asleep (and would ring): never neither.
TEST(LaneTest, ASleepingReaderNeverMissesABellAndBytes) {
  Pair p = MakePair(kMinLaneRingBytes);
  ASSERT_TRUE(p.creator && p.opener);
  constexpr int kRounds = 20000;
  std::atomic<int> turn{0};
  std::atomic<int> missed{0};
  std::atomic<bool> bell{false};
  std::thread writer([&] {
    for (int i = 0; i < kRounds; ++i) {
      while (turn.load() != 2 * i + 1) std::this_thread::yield();
      ASSERT_TRUE(p.creator->Write("x").ok());
      bell.store(p.creator->TakeDoorbell());
      turn.store(2 * i + 2);
    }
  });
  char c;
  for (int i = 0; i < kRounds; ++i) {
    turn.store(2 * i + 1);  // the writer may write from here, concurrently with Sleep()
    const bool seen = p.opener->Sleep();
    while (turn.load() != 2 * i + 2) std::this_thread::yield();
    if (!seen && !bell.load()) missed.fetch_add(1);
    p.opener->Wake();
    auto r = p.opener->Read(&c, 1);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(*r, 1u);
  }
  writer.join();
  EXPECT_EQ(missed.load(), 0);
}

}  // namespace
}  // namespace kvt::control::internal
