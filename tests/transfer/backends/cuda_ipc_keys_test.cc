// The cuda_ipc buffer keys of a whole descriptor (DecodePeerKeys) and the allocation index each
// key carries: buffers that are sub-ranges of a few large allocations, as serving engines'
// caching allocators hand them out, must name each allocation once, consistently, so that the
// receiving side opens each allocation once. Needs no GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda_ipc/cuda_ipc_codec.h"
#include "kvt/transfer/backend.h"

namespace kvt::transfer::cuda_ipc {
namespace {

using ::testing::HasSubstr;

IpcHandleBytes Handle(int seed) {
  IpcHandleBytes handle{};
  for (size_t i = 0; i < handle.size(); ++i) handle[i] = static_cast<char>(seed * 31 + i * 7 + 1);
  return handle;
}

// Six buffers carved out of two allocations at 256-byte-aligned offsets, interleaved the way a
// caching allocator may hand them out: allocation 0 holds buffers 0, 1, 3 and 5.
struct Carved {
  std::vector<RegionKey> keys;
  std::vector<RemoteRegion> regions;
};

Carved SixBuffersInTwoAllocations() {
  const uint64_t sizes[2] = {uint64_t{3} << 32, 1 << 20};  // above 4 GiB: all eight bytes matter
  const uint32_t allocation_of[6] = {0, 0, 1, 0, 1, 0};
  const uint64_t offsets[6] = {256, 256 + 12800, 0, (uint64_t{3} << 32) - 4096, 2560, 17408};
  const uint64_t lengths[6] = {12800, 4096, 2304, 4096, (1 << 20) - 2560, 768};
  Carved carved;
  for (int i = 0; i < 6; ++i) {
    RegionKey key;
    key.allocation = allocation_of[i];
    key.allocations = 2;
    key.handle = Handle(static_cast<int>(allocation_of[i]));
    key.offset = offsets[i];
    key.allocation_bytes = sizes[allocation_of[i]];
    carved.keys.push_back(key);
    carved.regions.push_back(
        RemoteRegion{0x7f0000000000ull + offsets[i], lengths[i], 256, EncodeRegionKey(key)});
  }
  return carved;
}

TEST(CudaIpcKeyIndexTest, RoundTripsIndexCountAndEveryField) {
  for (const RegionKey& key : SixBuffersInTwoAllocations().keys) {
    const std::string bytes = EncodeRegionKey(key);
    ASSERT_EQ(bytes.size(), kKeyBytes);
    EXPECT_EQ(static_cast<uint8_t>(bytes[4]), kKeyVersion);
    auto decoded = DecodeRegionKey(bytes, 0);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, key);
  }
}

TEST(CudaIpcKeyIndexTest, RefusesAnIndexOutOfRangeNamingBoth) {
  RegionKey key = SixBuffersInTwoAllocations().keys[2];
  key.allocation = 2;  // of 2 allocations
  auto past = DecodeRegionKey(EncodeRegionKey(key), 64);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr("allocation index 2"));
  EXPECT_THAT(past.status().message(), HasSubstr("the 2 allocations"));

  key.allocation = 0;
  key.allocations = 0;
  auto none = DecodeRegionKey(EncodeRegionKey(key), 64);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("out of range"));
}

TEST(CudaIpcKeyIndexTest, RefusesTruncatedKeysAtEveryLength) {
  const std::string bytes = EncodeRegionKey(SixBuffersInTwoAllocations().keys[1]);
  for (size_t size = 0; size < bytes.size(); ++size) {
    auto decoded = DecodeRegionKey(bytes.substr(0, size), 64);
    ASSERT_FALSE(decoded.ok()) << size;
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument) << size;
  }
}

TEST(CudaIpcKeyIndexTest, RefusesTheFormerVersionSayingSo) {
  std::string v1 = EncodeRegionKey(SixBuffersInTwoAllocations().keys[0]);
  v1[4] = 1;
  auto decoded = DecodeRegionKey(v1, 64);
  ASSERT_FALSE(decoded.ok());
  EXPECT_THAT(decoded.status().message(), HasSubstr("version 1"));
  EXPECT_THAT(decoded.status().message(),
              HasSubstr("reads version " + std::to_string(kKeyVersion)));
}

TEST(CudaIpcKeyIndexTest, RefusesAnOffsetPlusLengthBeyondTheAllocationNamingTheValues) {
  RegionKey key = SixBuffersInTwoAllocations().keys[4];  // allocation 1: 1 MiB
  key.offset = (1 << 20) - 256;
  auto past = DecodeRegionKey(EncodeRegionKey(key), 512);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr(std::to_string((1 << 20) - 256)));
  EXPECT_THAT(past.status().message(), HasSubstr("+512"));
  EXPECT_THAT(past.status().message(), HasSubstr(std::to_string(1 << 20) + " bytes"));
  EXPECT_THAT(past.status().message(), HasSubstr("past its end"));
  EXPECT_TRUE(DecodeRegionKey(EncodeRegionKey(key), 256).ok());  // ends exactly at the end

  key.offset = (1 << 20) + 256;  // starts beyond the allocation
  EXPECT_FALSE(DecodeRegionKey(EncodeRegionKey(key), 0).ok());
}

// ---- Whole descriptors ----------------------------------------------------------------------

TEST(CudaIpcPeerKeysTest, SixSubRangesOfTwoAllocationsNameEachAllocationOnce) {
  const Carved carved = SixBuffersInTwoAllocations();
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_TRUE(keys.ok()) << keys.status();
  ASSERT_EQ(keys->allocations.size(), 2u);
  EXPECT_EQ(keys->allocations[0], (PeerAllocation{Handle(0), uint64_t{3} << 32}));
  EXPECT_EQ(keys->allocations[1], (PeerAllocation{Handle(1), 1 << 20}));
  EXPECT_EQ(keys->allocation_of, (std::vector<uint32_t>{0, 0, 1, 0, 1, 0}));
  std::vector<uint64_t> offsets;
  for (const RegionKey& key : carved.keys) offsets.push_back(key.offset);
  EXPECT_EQ(keys->offsets, offsets);
}

TEST(CudaIpcPeerKeysTest, AnEmptyDescriptorHasNoAllocations) {
  auto keys = DecodePeerKeys({});
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_TRUE(keys->allocations.empty());
}

TEST(CudaIpcPeerKeysTest, AMalformedKeyIsRefusedNamingItsBuffer) {
  Carved carved = SixBuffersInTwoAllocations();
  carved.regions[3].key.resize(kKeyBytes - 9);
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(keys.status().message(), HasSubstr("buffer 3"));
  EXPECT_THAT(keys.status().message(), HasSubstr(std::to_string(kKeyBytes - 9) + " bytes"));

  carved = SixBuffersInTwoAllocations();
  carved.regions[5].length = 1 << 20;  // from offset 17408 of allocation 0: fits
  EXPECT_TRUE(DecodePeerKeys(carved.regions).ok());
  carved.regions[4].length = (1 << 20) - 2559;  // one byte past allocation 1
  keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), HasSubstr("buffer 4"));
  EXPECT_THAT(keys.status().message(), HasSubstr("past its end"));
}

TEST(CudaIpcPeerKeysTest, RefusesKeysDisagreeingOnTheAllocationCount) {
  Carved carved = SixBuffersInTwoAllocations();
  RegionKey key = carved.keys[3];
  key.allocations = 3;
  carved.regions[3].key = EncodeRegionKey(key);
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), HasSubstr("buffer 3 says its buffers lie in 3"));
  EXPECT_THAT(keys.status().message(), HasSubstr("buffer 0 says 2"));
}

TEST(CudaIpcPeerKeysTest, RefusesMoreAllocationsThanBuffers) {
  Carved carved = SixBuffersInTwoAllocations();
  for (size_t i = 0; i < carved.keys.size(); ++i) {
    RegionKey key = carved.keys[i];
    key.allocations = 7;
    carved.regions[i].key = EncodeRegionKey(key);
  }
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), HasSubstr("lie in 7 allocations"));
  EXPECT_THAT(keys.status().message(), HasSubstr("its 6 buffers"));
}

TEST(CudaIpcPeerKeysTest, RefusesAnIndexNoBufferNames) {
  Carved carved = SixBuffersInTwoAllocations();
  for (size_t i = 0; i < carved.keys.size(); ++i) {
    RegionKey key = carved.keys[i];
    key.allocations = 3;  // but only indices 0 and 1 are named
    carved.regions[i].key = EncodeRegionKey(key);
  }
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), HasSubstr("counts 3 allocations"));
  EXPECT_THAT(keys.status().message(), HasSubstr("allocation 2"));
}

TEST(CudaIpcPeerKeysTest, RefusesOneIndexWithTwoHandlesOrSizes) {
  Carved carved = SixBuffersInTwoAllocations();
  RegionKey key = carved.keys[3];
  key.handle = Handle(9);
  carved.regions[3].key = EncodeRegionKey(key);
  auto handle = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(handle.ok());
  EXPECT_THAT(handle.status().message(), HasSubstr("buffers 0 and 3 both lie in allocation 0"));

  carved = SixBuffersInTwoAllocations();
  key = carved.keys[4];
  key.allocation_bytes += 4096;
  carved.regions[4].key = EncodeRegionKey(key);
  auto size = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(size.ok());
  EXPECT_THAT(size.status().message(), HasSubstr("buffers 2 and 4 both lie in allocation 1"));
  EXPECT_THAT(size.status().message(), HasSubstr(std::to_string((1 << 20) + 4096)));
}

TEST(CudaIpcPeerKeysTest, RefusesOneHandleUnderTwoIndices) {
  // Opening one allocation twice fails in CUDA: the receiver must never be asked to.
  Carved carved = SixBuffersInTwoAllocations();
  for (size_t i = 0; i < carved.keys.size(); ++i) {
    RegionKey key = carved.keys[i];
    key.handle = Handle(0);
    key.allocation_bytes = uint64_t{3} << 32;
    carved.regions[i].key = EncodeRegionKey(key);
  }
  auto keys = DecodePeerKeys(carved.regions);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), HasSubstr("buffers 0 and 2 name one IPC handle"));
  EXPECT_THAT(keys.status().message(), HasSubstr("(0 and 1)"));
}

}  // namespace
}  // namespace kvt::transfer::cuda_ipc
