// Options of the cuda_ipc backend (CUDA IPC within one host: one gather/scatter kernel per layer
// batch writes straight into the peer's pool over NVLink or PCIe). It has no tunables yet; the
// struct exists so that every backend is chosen the same way (BackendConfig, backends.h).
#pragma once

namespace kvt::transfer {

struct CudaIpcOptions {};

}  // namespace kvt::transfer
