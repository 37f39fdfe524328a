#include "kvt/transfer/backends.h"

#include "backends/cuda_ipc/cuda_ipc_backend.h"
#include "backends/loopback/loopback_backend.h"
#include "backends/nccl/nccl_backend.h"
#include "backends/ucx/ucx_backend.h"

namespace kvt::transfer {

std::vector<std::string> BackendNames() { return {"ucx", "cuda_ipc", "nccl", "loopback"}; }

StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                 const BackendOptions& options) {
  if (name == "ucx") return CreateUcxBackend(options);
  if (name == "cuda_ipc") return CreateCudaIpcBackend(options);
  if (name == "nccl") return CreateNcclBackend(options);
  if (name == "loopback") return CreateLoopbackBackend(options);
  std::string known;
  for (const std::string& n : BackendNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown backend '" + std::string(name) + "'; this build has " + known);
}

namespace {

class BackendAllocator final : public pool::HostAllocator {
 public:
  explicit BackendAllocator(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes <= 0) return InvalidArgument("allocation of " + std::to_string(bytes) + " bytes");
    return backend_->AllocateHost(static_cast<size_t>(bytes));
  }
  void Free(void* block, int64_t) override { backend_->FreeHost(block); }
  std::string_view name() const override { return backend_->Name(); }

 private:
  const std::shared_ptr<Backend> backend_;
};

}  // namespace

std::shared_ptr<pool::HostAllocator> BackendHostAllocator(std::shared_ptr<Backend> backend) {
  if (!backend) return nullptr;
  // Probe with one page: backends without an allocator answer Unimplemented.
  StatusOr<void*> probe = backend->AllocateHost(4096);
  if (!probe.ok()) return nullptr;
  backend->FreeHost(*probe);
  return std::make_shared<BackendAllocator>(std::move(backend));
}

}  // namespace kvt::transfer
