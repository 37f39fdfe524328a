// Store (set_kv_buffer): validation, the byte-copy lowering, and the CPU reference.
#include <cstring>

#include "kvt/kernels/dtype_convert.h"
#include "kvt/kernels/kernels.h"
#include "page_copy_internal.h"
#include "store_dispatch.h"
#include "store_internal.h"
#include "validate.h"

namespace kvt::kernels {
namespace internal {

CopyDesc DescFromSameDtypeStore(const StoreArgs& a) {
  const int64_t row_bytes = a.row_elems * ItemSize(a.dst_dtype);
  CopyDesc d;
  // K and V are "buffers" 0 and 1: base + b * (V - K), modulo 2^64.
  d.src.base = reinterpret_cast<uint64_t>(a.k_src);
  d.src.buffer_stride = reinterpret_cast<uint64_t>(a.v_src) - reinterpret_cast<uint64_t>(a.k_src);
  d.src.page_stride = row_bytes;
  d.dst.base = reinterpret_cast<uint64_t>(a.k_dst);
  d.dst.buffer_stride = reinterpret_cast<uint64_t>(a.v_dst) - reinterpret_cast<uint64_t>(a.k_dst);
  d.dst.pages = a.loc;
  d.dst.page_stride = row_bytes;
  d.num_buffers = 2;
  d.num_pages = a.num_rows;
  d.bytes = row_bytes;
  return d;
}

}  // namespace internal

namespace {

template <typename Src, typename Dst>
void StoreRowsHost(const void* src_v, void* dst_v, const int32_t* loc, int64_t num_rows,
                   int64_t row_elems, bool has_scale, float scale) {
  using S = typename Src::Storage;
  using D = typename Dst::Storage;
  const S* src = static_cast<const S*>(src_v);
  D* dst = static_cast<D*>(dst_v);
  for (int64_t r = 0; r < num_rows; ++r) {
    const S* in = src + r * row_elems;
    D* out = dst + static_cast<int64_t>(loc[r]) * row_elems;
    for (int64_t e = 0; e < row_elems; ++e)
      out[e] = ConvertScaled<Src, Dst>(in[e], has_scale, scale);
  }
}

}  // namespace

Status StoreCpu(const StoreArgs& args) {
  KVT_RETURN_IF_ERROR(internal::ValidateStore(args, "StoreCpu"));
  if (args.num_rows == 0 || args.row_elems == 0) return OkStatus();
  if (args.src_dtype == args.dst_dtype) {
    internal::CopyHost(internal::DescFromSameDtypeStore(args));
    return OkStatus();
  }
  bool supported = internal::VisitConversion(args.src_dtype, args.dst_dtype, [&](auto s, auto d) {
    using Src = decltype(s);
    using Dst = decltype(d);
    StoreRowsHost<Src, Dst>(args.k_src, args.k_dst, args.loc, args.num_rows, args.row_elems,
                            args.has_k_scale, args.k_scale);
    StoreRowsHost<Src, Dst>(args.v_src, args.v_dst, args.loc, args.num_rows, args.row_elems,
                            args.has_v_scale, args.v_scale);
  });
  if (!supported) return Internal("StoreCpu: validated conversion has no implementation");
  return OkStatus();
}

}  // namespace kvt::kernels
