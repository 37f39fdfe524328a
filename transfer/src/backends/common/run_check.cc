#include "backends/common/run_check.h"

#include <string>

namespace kvt::transfer {

Status CheckRegionCount(size_t local, size_t remote) {
  if (local == remote) return OkStatus();
  return FailedPrecondition("the peer published " + std::to_string(remote) +
                            " buffers but this side registered " + std::to_string(local) +
                            "; both pools must expose the same buffer list (2 x layers)");
}

Status CheckRuns(std::span<const CopyRun> runs, std::span<const LocalRegion> local,
                 std::span<const RemoteRegion> remote) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const CopyRun& r = runs[i];
    const uint32_t dst = r.DstBuffer();
    if (r.buffer >= local.size()) {
      return OutOfRange("run " + std::to_string(i) + " reads buffer " + std::to_string(r.buffer) +
                        " but only " + std::to_string(local.size()) +
                        " are registered on this side");
    }
    if (dst >= remote.size()) {
      return OutOfRange("run " + std::to_string(i) + " writes buffer " + std::to_string(dst) +
                        " but the peer published only " + std::to_string(remote.size()));
    }
    const uint64_t src_len = local[r.buffer].length;
    const uint64_t dst_len = remote[dst].length;
    if (r.bytes > src_len || r.src_offset > src_len - r.bytes) {
      return OutOfRange("run " + std::to_string(i) + " reads [" + std::to_string(r.src_offset) +
                        ", +" + std::to_string(r.bytes) + ") past the end of local buffer " +
                        std::to_string(r.buffer) + " (" + std::to_string(src_len) + " bytes)");
    }
    if (r.bytes > dst_len || r.dst_offset > dst_len - r.bytes) {
      return OutOfRange("run " + std::to_string(i) + " writes [" + std::to_string(r.dst_offset) +
                        ", +" + std::to_string(r.bytes) + ") past the end of remote buffer " +
                        std::to_string(dst) + " (" + std::to_string(dst_len) + " bytes)");
    }
  }
  return OkStatus();
}

}  // namespace kvt::transfer
