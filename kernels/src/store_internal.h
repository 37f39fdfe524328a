// Private to kvt::kernels: a same-dtype store is a page copy (rows of K and V to rows `loc`).
#pragma once

#include "kvt/kernels/kernels.h"
#include "page_copy_internal.h"

namespace kvt::kernels::internal {

// Precondition: ValidateStore passed, src_dtype == dst_dtype, num_rows and row_elems > 0.
CopyDesc DescFromSameDtypeStore(const StoreArgs& args);

}  // namespace kvt::kernels::internal
