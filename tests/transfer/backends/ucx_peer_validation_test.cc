// What a ucx peer sends is checked before it reaches UCX (ucx_peer_check.h): worker addresses and
// packed keys that UCX itself produces pass, on tcp, the shared-memory transports and UCX's
// default choice; garbage, truncated or stretched ones are refused with an error and the backend
// still connects a good peer afterwards; a descriptor whose buffers lie outside what the peer's
// key maps into this process is refused at connect; and the mapping check itself refuses ranges
// past a mapping's end, across gaps, in private memory, over this side's own buffers, and past
// the end of a shared file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend_test_util.h"
#include "backends/ucx/ucx_backend.h"
#include "backends/ucx/ucx_peer_check.h"
#include "backends/ucx/ucx_staged_protocol.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer {
namespace {

using testing::WaitFor;
using ucx_check::CheckMappedForWrite;
using ucx_check::CheckPackedRkey;
using ucx_check::CheckWorkerAddress;

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// A UCP context and worker of their own, configured by UCX variable names without the UCX_
// prefix ("TLS", "ADDRESS_VERSION", ...), for addresses and keys exactly as UCX makes them.
class RawUcx {
 public:
  static std::unique_ptr<RawUcx> Create(
      const std::vector<std::pair<std::string, std::string>>& settings) {
    auto ucx = std::unique_ptr<RawUcx>(new RawUcx);
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return nullptr;
    for (const auto& [key, value] : settings) {
      if (ucp_config_modify(config, key.c_str(), value.c_str()) != UCS_OK) {
        ucp_config_release(config);
        return nullptr;
      }
    }
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
    const ucs_status_t st = ucp_init(&params, config, &ucx->context_);
    ucp_config_release(config);
    if (st != UCS_OK) return nullptr;
    ucp_worker_params_t wparams = {};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(ucx->context_, &wparams, &ucx->worker_) != UCS_OK) return nullptr;
    return ucx;
  }
  ~RawUcx() {
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  std::string Address() const {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    EXPECT_EQ(ucp_worker_get_address(worker_, &address, &length), UCS_OK);
    std::string bytes(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
    return bytes;
  }

  // The packed key of `length` bytes registered at `address`, or allocated by UCX (nullptr).
  std::string Key(void* address, size_t length) const {
    ucp_mem_map_params_t mp = {};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = address;
    mp.length = length;
    mp.flags = address == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h memh = nullptr;
    EXPECT_EQ(ucp_mem_map(context_, &mp, &memh), UCS_OK);
    if (memh == nullptr) return {};
    void* packed = nullptr;
    size_t packed_length = 0;
    EXPECT_EQ(ucp_rkey_pack(context_, memh, &packed, &packed_length), UCS_OK);
    std::string key(static_cast<const char*>(packed), packed_length);
    ucp_rkey_buffer_release(packed);
    ucp_mem_unmap(context_, memh);
    return key;
  }

  ucp_worker_h worker() const { return worker_; }

 private:
  RawUcx() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
};

// UCX_TLS values: tcp, each shared-memory transport, all of them, and UCX's default.
const std::vector<std::string> kTransports = {"tcp", "posix", "sysv", "cma", "shm", "shm,tcp", ""};

TEST(UcxPeerCheckTest, UcxsOwnAddressesAndKeysPass) {
  for (const std::string& tls : kTransports) {
    for (const char* version : {"v1", "v2"}) {
      for (const char* debug : {"n", "y"}) {
        std::vector<std::pair<std::string, std::string>> settings = {{"ADDRESS_VERSION", version},
                                                                     {"ADDRESS_DEBUG_INFO", debug}};
        if (!tls.empty()) settings.emplace_back("TLS", tls);
        auto ucx = RawUcx::Create(settings);
        if (ucx == nullptr) {
          ADD_FAILURE() << "UCX refuses UCX_TLS=" << tls;
          continue;
        }
        const std::string address = ucx->Address();
        EXPECT_TRUE(CheckWorkerAddress(Bytes(address)).ok())
            << "UCX_TLS=" << (tls.empty() ? "(default)" : tls) << " address " << version
            << " debug " << debug << ": " << CheckWorkerAddress(Bytes(address));
      }
    }
    auto ucx = RawUcx::Create(tls.empty()
                                  ? std::vector<std::pair<std::string, std::string>>{}
                                  : std::vector<std::pair<std::string, std::string>>{{"TLS", tls}});
    ASSERT_NE(ucx, nullptr);
    std::vector<uint8_t> registered(1 << 20);
    for (const std::string& key :
         {ucx->Key(registered.data(), registered.size()), ucx->Key(nullptr, 1 << 20)}) {
      EXPECT_TRUE(CheckPackedRkey(Bytes(key)).ok())
          << "UCX_TLS=" << tls << ": " << CheckPackedRkey(Bytes(key));
    }
  }
}

TEST(UcxPeerCheckTest, GarbageAddressesAreRefused) {
  auto ucx = RawUcx::Create({{"TLS", "tcp,shm"}});
  ASSERT_NE(ucx, nullptr);
  const std::string real = ucx->Address();
  ASSERT_TRUE(CheckWorkerAddress(Bytes(real)).ok());

  EXPECT_FALSE(CheckWorkerAddress({}).ok());
  // Every truncation and one byte too many.
  for (size_t n = 0; n < real.size(); ++n) {
    EXPECT_FALSE(CheckWorkerAddress(Bytes(real.substr(0, n))).ok()) << "first " << n << " bytes";
  }
  EXPECT_FALSE(CheckWorkerAddress(Bytes(real + '\0')).ok());
  // A version UCX would abort on, and the header's unknown v2 flags.
  std::string version5 = real;
  version5[0] = static_cast<char>((version5[0] & 0xf0) | 5);
  const Status v5 = CheckWorkerAddress(Bytes(version5));
  EXPECT_EQ(v5.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v5.message().find("format version 5"), std::string::npos) << v5;
  EXPECT_NE(v5.message().find("not a kvt agent"), std::string::npos) << v5;
  // The first device's address length (header, uuid, memory domain byte, then the length byte)
  // bumped: every record after it is read from the wrong place. The records hold this run's
  // ports and addresses, so one shifted read can parse as well-formed by chance; of three
  // different bumps at least one is refused.
  ASSERT_EQ(real[0] & 0x0f, 0) << "UCX's default address format is v1";
  ASSERT_EQ(real[0] & 0x10, 0) << "no debug information by default";
  int bumps_refused = 0;
  for (int bump : {1, 2, 3}) {
    std::string bumped = real;
    bumped[10] = static_cast<char>(bumped[10] + bump);
    bumps_refused += CheckWorkerAddress(Bytes(bumped)).ok() ? 0 : 1;
  }
  EXPECT_GE(bumps_refused, 1);
  // A device address length that runs past the end.
  std::string stretched = real.substr(0, 11);
  stretched[10] = static_cast<char>((stretched[10] & 0xe0) | 0x1e);
  const Status s = CheckWorkerAddress(Bytes(stretched));
  EXPECT_NE(s.message().find("device record 0 claims 30 bytes of address but 0 remain"),
            std::string::npos)
      << s;
  // Random bytes, short and long, and a huge buffer behind a valid header.
  // (A random string is sometimes a well-formed address by chance: the check is of the format,
  // not of the contents.)
  std::mt19937 rng(17);
  int refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 200, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    refused += CheckWorkerAddress(Bytes(bytes)).ok() ? 0 : 1;
  }
  EXPECT_GE(refused, 19900);
  std::string huge = real;
  huge.resize(64 << 20, '\x42');
  EXPECT_FALSE(CheckWorkerAddress(Bytes(huge)).ok());
  // Every single-byte change either passes as a well-formed address or is refused; none reads
  // past the end (run under the sanitizers through the fuzz target, too).
  for (size_t i = 0; i < real.size(); ++i) {
    std::string changed = real;
    changed[i] = static_cast<char>(changed[i] ^ 0x5a);
    (void)CheckWorkerAddress(Bytes(changed));
  }
}

TEST(UcxPeerCheckTest, GarbageKeysAreRefused) {
  auto ucx = RawUcx::Create({{"TLS", "tcp,shm"}});
  ASSERT_NE(ucx, nullptr);
  const std::string real = ucx->Key(nullptr, 1 << 20);
  ASSERT_TRUE(CheckPackedRkey(Bytes(real)).ok()) << CheckPackedRkey(Bytes(real));
  EXPECT_FALSE(CheckPackedRkey({}).ok());
  // What UCX packs for memory none of its domains registered: no domain, nothing to reach.
  const uint8_t no_domain[9] = {};
  EXPECT_TRUE(CheckPackedRkey(no_domain).ok());
  for (size_t n = 0; n < real.size(); ++n) {
    EXPECT_FALSE(CheckPackedRkey(Bytes(real.substr(0, n))).ok()) << "first " << n << " bytes";
  }
  EXPECT_FALSE(CheckPackedRkey(Bytes(real + "x")).ok());
  std::string memory_type = real;
  memory_type[8] = 9;
  EXPECT_NE(CheckPackedRkey(Bytes(memory_type)).message().find("memory type 9"), std::string::npos);
  std::string size = real;
  size[9] = static_cast<char>(0xff);  // the first domain's key claims 255 bytes
  const Status s = CheckPackedRkey(Bytes(size));
  EXPECT_NE(s.message().find("claims 255 bytes"), std::string::npos) << s;
  std::mt19937 rng(5);
  int refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    refused += CheckPackedRkey(Bytes(bytes)).ok() ? 0 : 1;
  }
  EXPECT_GE(refused, 19900);
}

// Without the check, an address of an unknown version reaches UCX's parser, which aborts the
// process (ucs_assertv_always in ucp_address_unpack_header): what the backend's Connect did.
TEST(UcxPeerCheckDeathTest, UcxAbortsOnAnAddressOfUnknownVersion) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The child aborts (UCX's default), never waits for a debugger or freezes.
  if (getenv("UCX_HANDLE_ERRORS") != nullptr) setenv("UCX_HANDLE_ERRORS", "bt", 1);
  EXPECT_DEATH(
      {
        auto ucx = RawUcx::Create({{"TLS", "tcp"}});
        std::string address = ucx->Address();
        address[0] = static_cast<char>((address[0] & 0xf0) | 5);
        ucp_ep_params_t ep = {};
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
        ucp_ep_h handle = nullptr;
        (void)ucp_ep_create(ucx->worker(), &ep, &handle);
      },
      "");
}

// ---- the backend -------------------------------------------------------------------------------

constexpr int kBuffers = 4;
constexpr uint64_t kItem = 4096;
constexpr uint64_t kBufferBytes = 64 * kItem;

class UcxPeerValidationTest : public ::testing::TestWithParam<std::string> {
 protected:
  // UcxOptions::direct_shm of both backends.
  virtual bool DirectShm() const { return true; }

  void SetUp() override {
    UcxOptions options;
    options.transports = GetParam();
    options.direct_shm = DirectShm();
    auto a = CreateUcxBackend(options);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateUcxBackend(options);
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    src_.assign(kBuffers * kBufferBytes, 0);
    std::mt19937 rng(1);
    for (uint8_t& byte : src_) byte = static_cast<uint8_t>(rng());
    // The receiver's buffers in memory its UCX shares with peers on this host (AllocateHost), so
    // that shared-memory transports map them into the sender (ucp_rkey_ptr).
    auto block = receiver_->AllocateHost(kBuffers * kBufferBytes);
    ASSERT_TRUE(block.ok()) << block.status();
    dst_ = static_cast<uint8_t*>(*block);
    std::memset(dst_, 0, kBuffers * kBufferBytes);
    std::vector<LocalRegion> src_regions, dst_regions;
    for (int b = 0; b < kBuffers; ++b) {
      src_regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(src_.data() + b * kBufferBytes),
                                        kBufferBytes, kItem, MemoryKind::kHost, -1});
      dst_regions.push_back(LocalRegion{reinterpret_cast<uint64_t>(dst_ + b * kBufferBytes),
                                        kBufferBytes, kItem, MemoryKind::kHost, -1});
    }
    ASSERT_TRUE(sender_->Register(src_regions).ok());
    auto descriptor = receiver_->Register(dst_regions);
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    good_ = *descriptor;
  }

  void TearDown() override {
    sender_.reset();
    if (receiver_ && dst_ != nullptr) receiver_->FreeHost(dst_);
    receiver_.reset();
  }

  // The good descriptor with its worker address replaced (the kvt trailer kept).
  PeerDescriptor WithWorkerAddress(std::string_view worker_address) const {
    const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(good_.address);
    EXPECT_TRUE(split.trailer.has_value());
    PeerDescriptor d = good_;
    d.address = ucx_staging::AppendTrailer(worker_address, *split.trailer);
    return d;
  }

  std::string_view GoodWorkerAddress() const {
    return ucx_staging::SplitPeerAddress(good_.address).worker_address;
  }

  // Lies about the receiver's buffers (beyond, before, around its allocation) are refused where
  // UCX maps the receiver's memory here; then the good descriptor still works.
  void LiesAreRefused();

  // Connects the good descriptor, writes a page into every buffer, and checks the bytes.
  void GoodPeerStillWorks() {
    auto peer = sender_->Connect(good_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    std::vector<CopyRun> runs;
    for (uint32_t b = 0; b < kBuffers; ++b) {
      runs.push_back({b, 3 * kItem, kBufferBytes - kItem, kItem});  // each buffer's last page
    }
    auto write = sender_->PostWrite(*peer, runs);
    ASSERT_TRUE(write.ok()) << write.status();
    ASSERT_TRUE(WaitFor(*sender_, *write).ok());
    sender_->Release(*write);
    for (const CopyRun& r : runs) {
      EXPECT_EQ(std::memcmp(dst_ + r.buffer * kBufferBytes + r.dst_offset,
                            src_.data() + r.buffer * kBufferBytes + r.src_offset, r.bytes),
                0)
          << "buffer " << r.buffer;
    }
    // A run past its buffer's end is refused, not written.
    const CopyRun past{0, 0, kBufferBytes - kItem + 1, kItem};
    auto refused = sender_->PostWrite(*peer, {&past, 1});
    EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange) << refused.status();
    EXPECT_TRUE(sender_->Disconnect(*peer).ok());
  }

  std::unique_ptr<Backend> sender_, receiver_;
  std::vector<uint8_t> src_;
  uint8_t* dst_ = nullptr;
  PeerDescriptor good_;
};

// Worker addresses made from `real` that UCX must never parse: another version, cut short,
// one byte too many, a lone byte, and `randoms` random ones (from `seed`).
std::vector<std::pair<std::string, std::string>> GarbageFrom(const std::string& real, int randoms,
                                                             uint32_t seed) {
  std::vector<std::pair<std::string, std::string>> garbage = {
      {"version 5", real},
      {"truncated", real.substr(0, real.size() / 2)},
      {"one byte short", real.substr(0, real.size() - 1)},
      {"trailing byte", real + '\x01'},
      {"one byte", "\x03"},
  };
  garbage[0].second[0] = static_cast<char>((real[0] & 0xf0) | 5);
  std::mt19937 rng(seed);
  for (int i = 0; i < randoms; ++i) {
    std::string bytes(1 + rng() % 300, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    garbage.emplace_back("random " + std::to_string(i), bytes);
  }
  return garbage;
}

TEST_P(UcxPeerValidationTest, GarbageAddressesAreRefusedAndAGoodPeerStillConnects) {
  const std::string real(GoodWorkerAddress());
  std::vector<std::pair<std::string, std::string>> garbage = GarbageFrom(real, 50, 7);
  garbage.emplace_back("huge", real + std::string(16 << 20, '\x07'));
  std::string stretched = real;
  stretched[10] = static_cast<char>(stretched[10] | 0x1f);
  garbage.emplace_back("device length stretched", stretched);
  for (const auto& [name, address] : garbage) {
    auto peer = sender_->Connect(WithWorkerAddress(address));
    EXPECT_EQ(peer.status().code(), StatusCode::kInvalidArgument) << name << ": " << peer.status();
  }
  // A well-formed address UCX itself refuses (no transport in common with this side's tcp) is
  // that connect's error too.
  if (GetParam() == "tcp") {
    auto shm_only = RawUcx::Create({{"TLS", "posix"}});
    ASSERT_NE(shm_only, nullptr);
    const std::string address = shm_only->Address();
    ASSERT_TRUE(CheckWorkerAddress(Bytes(address)).ok());
    auto peer = sender_->Connect(WithWorkerAddress(address));
    EXPECT_FALSE(peer.ok());
    EXPECT_NE(peer.status().message().find("ucp_ep_create"), std::string::npos) << peer.status();
  }
  // Garbage keys, too.
  PeerDescriptor bad_key = good_;
  bad_key.regions[2].key.resize(bad_key.regions[2].key.size() - 1);
  auto peer = sender_->Connect(bad_key);
  EXPECT_EQ(peer.status().code(), StatusCode::kInvalidArgument) << peer.status();
  EXPECT_NE(peer.status().message().find("buffer 2"), std::string::npos) << peer.status();
  bad_key = good_;
  bad_key.regions[0].key = std::string(40, '\xff');
  EXPECT_EQ(sender_->Connect(bad_key).status().code(), StatusCode::kInvalidArgument);
  GoodPeerStillWorks();
}

// The address of the worker that takes copy runs as active messages (in the kvt trailer) is
// checked like the RMA worker's before UCX parses it.
TEST_P(UcxPeerValidationTest, GarbageCopyRunAddressesAreRefusedAndAGoodPeerStillConnects) {
  const ucx_staging::SplitAddress split = ucx_staging::SplitPeerAddress(good_.address);
  ASSERT_TRUE(split.trailer.has_value());
  if (split.runs_address.empty()) {
    GTEST_SKIP() << "this receiver takes no copy runs as messages (UCX reaches it with puts)";
  }
  const std::vector<std::pair<std::string, std::string>> garbage =
      GarbageFrom(std::string(split.runs_address), 20, 11);
  for (const auto& [name, address] : garbage) {
    PeerDescriptor d = good_;
    d.address = ucx_staging::AppendTrailer(split.worker_address, *split.trailer, address);
    auto peer = sender_->Connect(d);
    EXPECT_EQ(peer.status().code(), StatusCode::kInvalidArgument) << name << ": " << peer.status();
    EXPECT_NE(peer.status().message().find("copy-run worker address"), std::string::npos)
        << name << ": " << peer.status();
  }
  GoodPeerStillWorks();
}

TEST_P(UcxPeerValidationTest, LyingDescriptorsAreRefusedAtConnect) { LiesAreRefused(); }

// Without direct copies UCX's shared-memory puts copy to the same mapped addresses: the same lies
// are refused.
class UcxPeerValidationNoDirectTest : public UcxPeerValidationTest {
 protected:
  bool DirectShm() const override { return false; }
};

TEST_P(UcxPeerValidationNoDirectTest, LyingDescriptorsAreRefusedAtConnect) { LiesAreRefused(); }

INSTANTIATE_TEST_SUITE_P(Transports, UcxPeerValidationNoDirectTest,
                         ::testing::Values("", "sysv", "posix", "tcp"),
                         testing::TransportsTestName);

void UcxPeerValidationTest::LiesAreRefused() {
  struct Lie {
    std::string name;
    int buffer;
    int64_t base_shift;
    uint64_t extra_length;
  };
  const std::vector<Lie> lies = {
      {"last buffer extended past the allocation", kBuffers - 1, 0, 64ull << 20},
      {"last buffer shifted past the allocation", kBuffers - 1, 64ll << 20, 0},
      {"first buffer shifted before the allocation", 0, -(64ll << 20), 0},
      {"first buffer stretched over the whole address space", 0, 0, ~0ull >> 4},
  };
  bool any_direct = false;
  for (const Lie& lie : lies) {
    PeerDescriptor d = good_;
    d.regions[lie.buffer].base += lie.base_shift;
    d.regions[lie.buffer].length += lie.extra_length;
    auto peer = sender_->Connect(d);
    if (peer.ok()) {
      // Over the network the receiver's memory is the receiver's own business (UCX writes
      // there on its side); only where it is mapped here must a lie be refused.
      EXPECT_EQ(GetParam(), "tcp")
          << lie.name << ": a lie was accepted with UCX_TLS=" << GetParam();
      EXPECT_TRUE(sender_->Disconnect(*peer).ok());
      continue;
    }
    any_direct = true;
    EXPECT_EQ(peer.status().code(), StatusCode::kInvalidArgument) << lie.name;
    EXPECT_NE(peer.status().message().find("buffer " + std::to_string(lie.buffer)),
              std::string::npos)
        << lie.name << ": " << peer.status();
  }
  if (GetParam() != "tcp") {
    EXPECT_TRUE(any_direct);
  }
  GoodPeerStillWorks();
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxPeerValidationTest,
                         ::testing::Values("", "sysv", "posix", "shm", "tcp"),
                         testing::TransportsTestName);

// ---- the mapping check -------------------------------------------------------------------------

TEST(UcxMappingCheckTest, ParsesProcMaps) {
  const auto maps = ucx_check::ParseMaps(
      "7f0000000000-7f0000004000 rw-s 00002000 00:1a 1234                       /dev/shm/seg\n"
      "7f0000004000-7f0000005000 r--p 00000000 00:00 0 \n"
      "garbage\n"
      "7f0000006000-7f0000007000 rw-s 00000000 00:05 99 /SYSV00000000 (deleted)\n");
  ASSERT_EQ(maps.size(), 3u);
  EXPECT_EQ(maps[0].begin, 0x7f0000000000u);
  EXPECT_EQ(maps[0].end, 0x7f0000004000u);
  EXPECT_TRUE(maps[0].writable && maps[0].shared);
  EXPECT_EQ(maps[0].offset, 0x2000u);
  EXPECT_EQ(maps[0].inode, 1234u);
  EXPECT_EQ(maps[0].path, "/dev/shm/seg");
  EXPECT_FALSE(maps[1].writable || maps[1].shared);
  EXPECT_TRUE(maps[1].path.empty());
  EXPECT_EQ(maps[2].path, "/SYSV00000000 (deleted)");
}

// A shared file of one page mapped as two: the second page raises SIGBUS on access.
class SharedFile {
 public:
  SharedFile(size_t file_bytes, size_t map_bytes) : map_bytes_(map_bytes) {
    char path[] = "/dev/shm/kvt_peer_check_XXXXXX";
    fd_ = mkstemp(path);
    if (fd_ < 0) return;
    path_ = path;
    if (ftruncate(fd_, static_cast<off_t>(file_bytes)) != 0) return;
    void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) base_ = static_cast<uint8_t*>(p);
  }
  ~SharedFile() {
    if (base_ != nullptr) munmap(base_, map_bytes_);
    if (fd_ >= 0) close(fd_);
    if (!path_.empty()) unlink(path_.c_str());
  }
  uint8_t* base() const { return base_; }
  void Unlink() {
    unlink(path_.c_str());
    path_.clear();
  }

 private:
  size_t map_bytes_;
  int fd_ = -1;
  std::string path_;
  uint8_t* base_ = nullptr;
};

TEST(UcxMappingCheckTest, RefusesRangesOutsideASharedMappingAndPastTheFile) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  SharedFile file(page, 2 * page);
  ASSERT_NE(file.base(), nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(file.base());
  auto maps = ucx_check::ReadSelfMaps();
  ASSERT_TRUE(maps.ok()) << maps.status();
  // Inside the file: fine.
  EXPECT_TRUE(CheckMappedForWrite(0, 0x1000, page, base, *maps, {}).ok())
      << CheckMappedForWrite(0, 0x1000, page, base, *maps, {});
  // Mapped, but past the file's end: a store there raises SIGBUS.
  const Status past_file = CheckMappedForWrite(1, 0x1000, page + 1, base, *maps, {});
  EXPECT_EQ(past_file.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past_file.message().find("buffer 1"), std::string::npos) << past_file;
  EXPECT_NE(past_file.message().find("the file holds"), std::string::npos) << past_file;
  // The same once the file is unlinked (as UCX's segments are): probed instead of stat'ed.
  file.Unlink();
  maps = ucx_check::ReadSelfMaps();
  ASSERT_TRUE(maps.ok());
  const Status unlinked = CheckMappedForWrite(1, 0x1000, page + 1, base, *maps, {});
  EXPECT_NE(unlinked.message().find("cannot be accessed"), std::string::npos) << unlinked;
  // Past the mapping's end.
  EXPECT_FALSE(CheckMappedForWrite(0, 0x1000, 3 * page, base, *maps, {}).ok());
  // Over this side's own buffer.
  const ucx_check::Range own{base + page / 2, 16};
  const Status overlap = CheckMappedForWrite(0, 0x1000, page, base, *maps, {&own, 1});
  EXPECT_NE(overlap.message().find("own buffer 0"), std::string::npos) << overlap;
  // Private memory (this process's heap) and nowhere at all.
  std::vector<uint8_t> heap(1 << 20);
  EXPECT_FALSE(
      CheckMappedForWrite(0, 0, 4096, reinterpret_cast<uint64_t>(heap.data()), *maps, {}).ok());
  EXPECT_FALSE(CheckMappedForWrite(0, 0, 4096, 16, *maps, {}).ok());
  EXPECT_FALSE(CheckMappedForWrite(0, 0, ~0ull, base, *maps, {}).ok());
}

// Only what was mapped meanwhile (by unpacking the peer's keys) counts: another peer's shared
// memory, mapped before, does not.
TEST(UcxMappingCheckTest, OnlyMappingsMadeMeanwhileCount) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  SharedFile older(page, page);
  ASSERT_NE(older.base(), nullptr);
  auto before = ucx_check::ReadSelfMaps();
  ASSERT_TRUE(before.ok());
  SharedFile newer(page, page);
  ASSERT_NE(newer.base(), nullptr);
  auto after = ucx_check::ReadSelfMaps();
  ASSERT_TRUE(after.ok());
  const std::vector<ucx_check::Mapping> made = ucx_check::NewMappings(*before, *after);
  const uint64_t newer_base = reinterpret_cast<uint64_t>(newer.base());
  const uint64_t older_base = reinterpret_cast<uint64_t>(older.base());
  EXPECT_TRUE(CheckMappedForWrite(0, 0, page, newer_base, made, {}).ok())
      << CheckMappedForWrite(0, 0, page, newer_base, made, {});
  const Status old = CheckMappedForWrite(2, 0, page, older_base, made, {});
  EXPECT_NE(old.message().find("no mapping made here for the peer's keys"), std::string::npos)
      << old;
  EXPECT_NE(old.message().find("buffer 2"), std::string::npos) << old;
}

TEST(UcxMappingCheckTest, FollowsContiguousMappingsOfOneFileAndStopsAtGaps) {
  const auto maps = ucx_check::ParseMaps(
      "10000-20000 rw-s 00000000 00:1a 7 /x\n"
      "20000-30000 rw-s 00010000 00:1a 7 /x\n"
      "30000-40000 rw-s 00030000 00:1a 7 /x\n"  // a hole in the file's offsets
      "50000-60000 rw-s 00000000 00:1a 8 /y\n");
  const Status ok = CheckMappedForWrite(0, 0, 0x10000, 0x18000, maps, {});
  // The range is not in this process's real maps, so the last-byte probe refuses it; what
  // matters here is that the walk got past the mapping boundary.
  EXPECT_EQ(ok.message().find("ends at"), std::string::npos) << ok;
  const Status hole = CheckMappedForWrite(0, 0, 0x10000, 0x28000, maps, {});
  EXPECT_NE(hole.message().find("ends at 0x30000"), std::string::npos) << hole;
  const Status gap = CheckMappedForWrite(0, 0, 0x10000, 0x58000, maps, {});
  EXPECT_NE(gap.message().find("ends at 0x60000"), std::string::npos) << gap;
}

}  // namespace
}  // namespace kvt::transfer
