#include "backends/common/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace kvt::transfer {

bool HostRangeMapped(uint64_t ptr, uint64_t length) {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t begin = ptr / page * page;
  const uint64_t end = ptr + length;
  constexpr uint64_t kWindowPages = 1 << 16;
  std::vector<unsigned char> residency(kWindowPages);
  while (begin < end) {
    const uint64_t bytes = std::min(end - begin, kWindowPages * page);
    if (mincore(reinterpret_cast<void*>(begin), bytes, residency.data()) != 0) return false;
    begin += bytes;
  }
  return true;
}

Status CheckHostRegionsMapped(std::span<const LocalRegion> regions, std::string_view backend) {
  for (size_t i = 0; i < regions.size(); ++i) {
    const LocalRegion& r = regions[i];
    if (r.kind != MemoryKind::kHost || r.length == 0) continue;
    if (r.base > UINT64_MAX - r.length || !HostRangeMapped(r.base, r.length)) {
      char range[64];
      std::snprintf(range, sizeof(range), "[0x%llx, 0x%llx)",
                    static_cast<unsigned long long>(r.base),
                    static_cast<unsigned long long>(r.base + r.length));
      return InvalidArgument(std::string(backend) + ": buffer " + std::to_string(i) + " " + range +
                             " of " + std::to_string(r.length) +
                             " bytes is not mapped host memory of this process; register memory "
                             "this process allocated, and keep it allocated while registered");
    }
  }
  return OkStatus();
}

}  // namespace kvt::transfer
