// StoreCuda: same dtype lowers to the page-copy kernel; otherwise one launch converts K and V
// rows element by element with the host/device conversions of dtype_convert.h, so the bytes
// equal StoreCpu's exactly.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/dtype_convert.h"
#include "kvt/kernels/kernels.h"
#include "kvt/kernels/tuning.h"
#include "page_copy_internal.h"
#include "store_dispatch.h"
#include "store_internal.h"
#include "validate.h"

namespace kvt::kernels {
namespace {

constexpr int kStoreThreads = 256;

// Block per row (K rows first, then V rows) in a grid-stride loop; threads stride the elements
// so loads and stores coalesce.
template <typename Src, typename Dst>
__global__ void StoreConvertKernel(const typename Src::Storage* __restrict__ k_src,
                                   const typename Src::Storage* __restrict__ v_src,
                                   typename Dst::Storage* __restrict__ k_dst,
                                   typename Dst::Storage* __restrict__ v_dst,
                                   const int32_t* __restrict__ loc, int64_t num_rows,
                                   int64_t row_elems, bool has_k_scale, float k_scale,
                                   bool has_v_scale, float v_scale) {
  for (int64_t r = blockIdx.x; r < 2 * num_rows; r += gridDim.x) {
    const bool is_v = r >= num_rows;
    const int64_t row = is_v ? r - num_rows : r;
    const typename Src::Storage* in = (is_v ? v_src : k_src) + row * row_elems;
    typename Dst::Storage* out =
        (is_v ? v_dst : k_dst) + static_cast<int64_t>(__ldg(loc + row)) * row_elems;
    const bool has_scale = is_v ? has_v_scale : has_k_scale;
    const float scale = is_v ? v_scale : k_scale;
    for (int64_t e = threadIdx.x; e < row_elems; e += blockDim.x) {
      out[e] = ConvertScaled<Src, Dst>(in[e], has_scale, scale);
    }
  }
}

}  // namespace

Status StoreCuda(const StoreArgs& args, cudaStream_t stream) {
  KVT_RETURN_IF_ERROR(internal::ValidateStore(args, "StoreCuda"));
  if (args.num_rows == 0 || args.row_elems == 0) return OkStatus();
  if (args.src_dtype == args.dst_dtype) {
    return internal::CopyDevice(internal::DescFromSameDtypeStore(args), DefaultPageCopyTuning(),
                                stream);
  }
  KVT_ASSIGN_OR_RETURN(int sms, internal::CurrentDeviceSmCount());
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(2 * args.num_rows, static_cast<int64_t>(sms) * 8));
  bool supported = internal::VisitConversion(args.src_dtype, args.dst_dtype, [&](auto s, auto d) {
    using Src = decltype(s);
    using Dst = decltype(d);
    using S = typename Src::Storage;
    using D = typename Dst::Storage;
    StoreConvertKernel<Src, Dst><<<grid, kStoreThreads, 0, stream>>>(
        static_cast<const S*>(args.k_src), static_cast<const S*>(args.v_src),
        static_cast<D*>(args.k_dst), static_cast<D*>(args.v_dst), args.loc, args.num_rows,
        args.row_elems, args.has_k_scale, args.k_scale, args.has_v_scale, args.v_scale);
  });
  if (!supported) return Internal("StoreCuda: validated conversion has no implementation");
  return cuda::LastLaunchStatus("StoreConvertKernel");
}

}  // namespace kvt::kernels
