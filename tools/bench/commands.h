// The subcommands of kvt-bench. Each lives in its own bench_<name>.cc and adds itself to the
// CLI11 app; main.cc calls every Add*Command. Not thread-safe (runs once at startup).
#pragma once

#include <CLI/CLI.hpp>

namespace kvt::bench {

// `kvt-bench kernels`: page gather/scatter kernel vs contiguous memcpy and the peers' ways.
void AddKernelsCommand(CLI::App& app, int& exit_code);

// `kvt-bench transfer`: TransferEngine between two processes vs the ceilings of the same run —
// host pools (memcpy, contiguous put) or CUDA pools on one GPU (contiguous cudaMemcpy, the peers'
// per-page ways through CUDA IPC, PCIe for staged UCX, a layerwise forward). Also registers its
// hidden `transfer-peer` child command.
void AddTransferCommand(CLI::App& app, int& exit_code);

// `kvt-bench load`: a bootstrap and many kvt-agent processes on loopback under many requests in
// flight, every byte verified: throughput, latency percentiles, failures, peak RSS per agent;
// the ceiling is the same requests through one prefill and one decode agent.
void AddLoadCommand(CLI::App& app, int& exit_code);

// `kvt-bench copy`: the ucx shared-memory path's host copy alone (StreamCopyRuns by 1..N threads
// over random runs) vs one thread's contiguous memcpy of the same bytes: what the machine allows.
void AddCopyCommand(CLI::App& app, int& exit_code);

// `kvt-bench cuda-calls`: the CUDA runtime calls of a one-page cuda_ipc write, each timed alone,
// and the launch's latency until its completion is seen: the floor under a one-page request.
void AddCudaCallsCommand(CLI::App& app, int& exit_code);

// `kvt-bench control`: the control plane alone, TransferRequest / TransferDone round trips
// between two io threads over a socket (sleeping or polling) or a lane: the floor under a
// request's two control messages.
void AddControlCommand(CLI::App& app, int& exit_code);

}  // namespace kvt::bench
