#include "kvt/pool/pool_options.h"

namespace kvt::pool {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

}  // namespace kvt::pool
