// cuda_util.h on any machine: no crash without a driver or GPU, and a reason when there is none.
#include "kvt/kernels/cuda_util.h"

#include <gtest/gtest.h>

#include <string>

namespace kvt::cuda {
namespace {

TEST(CudaUtilTest, DeviceCountNeverFailsAndExplainsZero) {
  DeviceCountResult r = DeviceCount();
  EXPECT_GE(r.count, 0);
  if (r.count == 0) {
    EXPECT_FALSE(r.reason.empty());
    EXPECT_NE(r.reason.find("cudaGetDeviceCount"), std::string::npos) << r.reason;
  } else {
    EXPECT_TRUE(r.reason.empty()) << r.reason;
  }
  EXPECT_EQ(HasDevice(), r.count > 0);
}

TEST(CudaUtilTest, ToStatusMapsCodes) {
  EXPECT_TRUE(ToStatus(cudaSuccess, "x").ok());
  Status no_device = ToStatus(cudaErrorNoDevice, "cudaSetDevice");
  EXPECT_EQ(no_device.code(), StatusCode::kUnavailable);
  EXPECT_NE(no_device.message().find("cudaSetDevice: cudaErrorNoDevice: "), std::string::npos)
      << no_device;
  EXPECT_EQ(ToStatus(cudaErrorInsufficientDriver, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(ToStatus(cudaErrorInvalidValue, "x").code(), StatusCode::kInternal);
}

TEST(CudaUtilTest, ObjectsWorkOrFailCleanlyWithoutDevice) {
  DeviceBuffer empty;
  EXPECT_EQ(empty.data(), nullptr);
  auto zero = DeviceBuffer::Allocate(0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->size(), 0u);
  EXPECT_EQ(Copy(nullptr, nullptr, 0), OkStatus());
  EXPECT_EQ(Copy(nullptr, &empty, 4).code(), StatusCode::kInvalidArgument);
  CompletionWord no_word;
  EXPECT_FALSE(no_word.valid());
  if (HasDevice()) GTEST_SKIP() << "a device is present; the no-device paths are not reachable";
  auto word = CompletionWord::Create(0);
  EXPECT_FALSE(word.ok()) << "a completion word without a device";
  auto buf = DeviceBuffer::Allocate(64);
  EXPECT_FALSE(buf.ok());
  auto stream = Stream::Create();
  EXPECT_FALSE(stream.ok());
  Event event;
  EXPECT_EQ(event.Record(nullptr).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvt::cuda
