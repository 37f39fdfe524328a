// Tiled all-layer row copy (move_kv_cache): tile-size rule and CPU reference.
#include <cstring>
#include <string>

#include "kvt/kernels/kernels.h"
#include "validate.h"

namespace kvt::kernels {

int32_t TileBytesForStride(int64_t stride_bytes) {
  if (stride_bytes >= 8192) return 512;
  if (stride_bytes >= 4096) return 256;
  return 128;
}

Status TiledCopyCpu(const TiledCopyArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidateTiledCopy(args, "TiledCopyCpu"));
  if (args.num_buffers == 0 || args.num_locs == 0 || args.max_row_bytes == 0) return OkStatus();
  // Host tables are readable here, so check what the CUDA version has to trust.
  for (int32_t b = 0; b < args.num_buffers; ++b) {
    if (args.row_bytes[b] < 0 || args.row_bytes[b] > args.max_row_bytes) {
      return InvalidArgument("TiledCopyCpu: row_bytes[" + std::to_string(b) + "] is " +
                             std::to_string(args.row_bytes[b]) + "; it must be in [0, " +
                             "max_row_bytes = " + std::to_string(args.max_row_bytes) + "]");
    }
  }
  for (int32_t b = 0; b < args.num_buffers; ++b) {
    const int64_t row = args.row_bytes[b];
    char* base = reinterpret_cast<char*>(args.bases[b]);
    for (int64_t i = 0; i < args.num_locs; ++i) {
      std::memcpy(base + static_cast<int64_t>(args.tgt_loc[i]) * row,
                  base + static_cast<int64_t>(args.src_loc[i]) * row, static_cast<size_t>(row));
    }
  }
  return OkStatus();
}

}  // namespace kvt::kernels
