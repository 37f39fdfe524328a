// TiledCopyCuda (move_kv_cache): grid (buffer, tile, slice of locs). A block copies its tile of
// every row pair in its slice; 16-byte accesses when the buffer base, its row size and the tile
// size are all 16-aligned, bytes otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "validate.h"

namespace kvt::kernels {
namespace {

constexpr int kTiledThreads = 256;
constexpr int64_t kTiledBytesPerBlock = 16384;  // tile bytes a block moves per loc slice
constexpr unsigned kMaxGridYZ = 65535;

template <typename T>
__device__ __forceinline__ void CopyTile(uint64_t base, int64_t row, const int32_t* tgt,
                                         const int32_t* src, int64_t loc_begin, int64_t loc_end,
                                         int64_t tile_start, int64_t tile_len) {
  const int64_t chunks = tile_len / static_cast<int64_t>(sizeof(T));
  const int64_t work = (loc_end - loc_begin) * chunks;
  for (int64_t f = threadIdx.x; f < work; f += blockDim.x) {
    const int64_t l = loc_begin + f / chunks;
    const int64_t c = f - (l - loc_begin) * chunks;
    const int64_t off = tile_start + c * static_cast<int64_t>(sizeof(T));
    const T* s = reinterpret_cast<const T*>(base + __ldg(src + l) * row + off);
    T* t = reinterpret_cast<T*>(base + __ldg(tgt + l) * row + off);
    *t = __ldg(s);
  }
}

__global__ void TiledCopyKernel(const uint64_t* __restrict__ bases,
                                const int64_t* __restrict__ row_bytes,
                                const int32_t* __restrict__ tgt_loc,
                                const int32_t* __restrict__ src_loc, int64_t num_locs,
                                int64_t tile_bytes, int64_t locs_per_slice) {
  const int64_t b = blockIdx.x;
  const uint64_t base = __ldg(bases + b);
  const int64_t row = __ldg(row_bytes + b);
  const bool vec =
      ((base | static_cast<uint64_t>(row) | static_cast<uint64_t>(tile_bytes)) & 15) == 0;
  for (int64_t tile = blockIdx.y; tile * tile_bytes < row; tile += gridDim.y) {
    const int64_t tile_start = tile * tile_bytes;
    const int64_t tile_len = min(tile_bytes, row - tile_start);
    for (int64_t begin = blockIdx.z * locs_per_slice; begin < num_locs;
         begin += static_cast<int64_t>(gridDim.z) * locs_per_slice) {
      const int64_t end = min(num_locs, begin + locs_per_slice);
      if (vec) {
        CopyTile<uint4>(base, row, tgt_loc, src_loc, begin, end, tile_start, tile_len);
      } else {
        CopyTile<unsigned char>(base, row, tgt_loc, src_loc, begin, end, tile_start, tile_len);
      }
    }
  }
}

}  // namespace

Status TiledCopyCuda(const TiledCopyArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidateTiledCopy(args, "TiledCopyCuda"));
  if (args.num_buffers == 0 || args.num_locs == 0 || args.max_row_bytes == 0) return OkStatus();
  const int64_t tile = args.bytes_per_tile;
  const int64_t tiles = (args.max_row_bytes + tile - 1) / tile;
  const int64_t locs_per_slice = std::max<int64_t>(1, kTiledBytesPerBlock / tile);
  const int64_t slices = (args.num_locs + locs_per_slice - 1) / locs_per_slice;
  dim3 grid(static_cast<unsigned>(args.num_buffers),
            static_cast<unsigned>(std::min<int64_t>(tiles, kMaxGridYZ)),
            static_cast<unsigned>(std::min<int64_t>(slices, kMaxGridYZ)));
  TiledCopyKernel<<<grid, kTiledThreads, 0, stream>>>(
      args.bases, args.row_bytes, args.tgt_loc, args.src_loc, args.num_locs, tile, locs_per_slice);
  return cuda::LastLaunchStatus("TiledCopyKernel");
}

}  // namespace kvt::kernels
