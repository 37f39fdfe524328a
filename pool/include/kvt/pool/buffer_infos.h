// ContiguousBufInfos: what a transfer engine registers for PD disaggregation (tokenspeed's
// get_contiguous_buf_infos): 2L entries each, K of layers 0..L-1 then V of layers 0..L-1.
// Page p of entry i starts at data_ptrs[i] + p * item_lens[i]. A value; thread-safe as any.
#pragma once

#include <cstdint>
#include <vector>

namespace kvt::pool {

struct ContiguousBufInfos {
  std::vector<uint64_t> data_ptrs;  // buffer base addresses (host or device, as the pool's)
  std::vector<int64_t> data_lens;   // whole buffer bytes
  std::vector<int64_t> item_lens;   // bytes of one page of one layer's K or V
};

}  // namespace kvt::pool
