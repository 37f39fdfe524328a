// Experiment (not part of the build): what bounds staged UCX between two processes on one GPU?
// Every byte of a staged transfer crosses PCIe twice: the sender's gather kernel stores it into a
// pinned host slot (GPU -> host), the receiver's copy engine reads it back (host -> GPU) and its
// scatter kernel places it. PCIe is full duplex, so the two legs could each run at the one-way
// rate; kvt-bench measures staged transfers at about half of a contiguous D2H copy
// (docs/performance.md). This program times each way of moving bytes across PCIe alone, and then
// two of them at once, in one process (two streams) and in two processes (two CUDA contexts on
// the same GPU, as a staged prefill and decode on one GPU are):
//   d2h / h2d   - cudaMemcpyAsync between device memory and pinned host memory (copy engines)
//   kstore      - a kernel storing device data into pinned host memory (the gather into a slot)
//   kload       - a kernel loading pinned host memory into device memory (a scatter reading the
//                 slot in place)
// Each way runs for a fixed time on 16 MiB chunks (two in flight) and reports GB/s. Pairs start
// together at one CLOCK_MONOTONIC instant, chosen before the fork (CUDA is initialised after it).
// Build and run (on a machine with a GPU):
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/bench/experiments/pcie_duplex.cu -o pcie_duplex
//   ./pcie_duplex
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr size_t kChunk = 16u << 20;
constexpr double kSeconds = 0.6;

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

__global__ void Store(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// One way of moving kChunk bytes, enqueued on `s`.
struct Way {
  std::string name;
  void* dev = nullptr;
  void* host = nullptr;
  int sms = 0;
  void Prepare() {
    CHECK(cudaMalloc(&dev, kChunk));
    CHECK(cudaHostAlloc(&host, kChunk, cudaHostAllocPortable));
    CHECK(cudaMemset(dev, 0x5A, kChunk));
    std::memset(host, 0xA5, kChunk);
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  }
  void Enqueue(cudaStream_t s) {
    const size_t n = kChunk / sizeof(uint4);
    if (name == "d2h") {
      CHECK(cudaMemcpyAsync(host, dev, kChunk, cudaMemcpyDeviceToHost, s));
    } else if (name == "h2d") {
      CHECK(cudaMemcpyAsync(dev, host, kChunk, cudaMemcpyHostToDevice, s));
    } else if (name == "kstore") {
      Store<<<sms * 4, 512, 0, s>>>(static_cast<const uint4*>(dev), static_cast<uint4*>(host), n);
    } else if (name == "kload") {
      Store<<<sms * 4, 512, 0, s>>>(static_cast<const uint4*>(host), static_cast<uint4*>(dev), n);
    } else {
      std::fprintf(stderr, "unknown way %s\n", name.c_str());
      std::exit(2);
    }
  }
};

// Runs `way` on its own stream from `start` for kSeconds; returns GB/s.
double Run(Way& way, cudaStream_t s, double start) {
  way.Enqueue(s);  // warm-up
  CHECK(cudaStreamSynchronize(s));
  while (Now() < start) {
  }
  const double t0 = Now();
  size_t chunks = 0;
  cudaEvent_t marks[2];
  CHECK(cudaEventCreateWithFlags(&marks[0], cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&marks[1], cudaEventDisableTiming));
  way.Enqueue(s);
  CHECK(cudaEventRecord(marks[0], s));
  for (int k = 1;; k ^= 1) {
    way.Enqueue(s);
    CHECK(cudaEventRecord(marks[k], s));
    CHECK(cudaEventSynchronize(marks[k ^ 1]));
    ++chunks;
    if (Now() - t0 > kSeconds) break;
  }
  CHECK(cudaStreamSynchronize(s));
  ++chunks;
  const double t1 = Now();
  return static_cast<double>(chunks * kChunk) / (t1 - t0) / 1e9;
}

double Alone(const char* name) {
  Way w{name};
  w.Prepare();
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Run(w, s, Now());
}

// Two ways at once in this process, each on its own stream and thread-free: both are enqueued
// from one loop so neither waits for the other's completion.
void SameProcess(const char* a, const char* b, double* ga, double* gb) {
  Way wa{a}, wb{b};
  wa.Prepare();
  wb.Prepare();
  cudaStream_t sa, sb;
  CHECK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  const double t0 = Now();
  size_t na = 0, nb = 0;
  while (Now() - t0 < kSeconds) {
    if (cudaStreamQuery(sa) == cudaSuccess) {
      wa.Enqueue(sa);
      wa.Enqueue(sa);
      na += 2;
    }
    if (cudaStreamQuery(sb) == cudaSuccess) {
      wb.Enqueue(sb);
      wb.Enqueue(sb);
      nb += 2;
    }
  }
  CHECK(cudaStreamSynchronize(sa));
  const double ta = Now();
  CHECK(cudaStreamSynchronize(sb));
  const double tb = Now();
  *ga = static_cast<double>(na * kChunk) / (ta - t0) / 1e9;
  *gb = static_cast<double>(nb * kChunk) / (tb - t0) / 1e9;
}

// Runs `name` in a new process from `start`; its GB/s arrive on the returned descriptor.
int Spawn(const char* name, double start, pid_t* pid) {
  int fds[2];
  if (pipe(fds) != 0) std::exit(3);
  *pid = fork();
  if (*pid == 0) {
    close(fds[0]);
    Way w{name};
    w.Prepare();
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const double g = Run(w, s, start);
    if (write(fds[1], &g, sizeof g) != sizeof g) _exit(4);
    _exit(0);
  }
  close(fds[1]);
  return fds[0];
}

// Two ways at once in two processes (children: this process never initialises CUDA, so that it
// can fork again).
void TwoProcesses(const char* a, const char* b, double* ga, double* gb) {
  const double start = Now() + 1.5;  // both have set up their contexts by then
  pid_t pa = 0, pb = 0;
  const int fa = Spawn(a, start, &pa);
  const int fb = Spawn(b, start, &pb);
  if (read(fa, ga, sizeof *ga) != sizeof *ga) *ga = -1;
  if (read(fb, gb, sizeof *gb) != sizeof *gb) *gb = -1;
  close(fa);
  close(fb);
  int status = 0;
  waitpid(pa, &status, 0);
  waitpid(pb, &status, 0);
}

int main(int argc, char** argv) {
  const bool two = argc > 1 && std::strcmp(argv[1], "--two") == 0;
  if (two) {
    const char* pairs[][2] = {{"d2h", "h2d"},   {"kstore", "h2d"}, {"kstore", "kload"},
                              {"d2h", "kload"}, {"d2h", "d2h"},    {"kstore", "kstore"}};
    std::printf("two processes on one GPU, GB/s of each while both run\n");
    for (auto& p : pairs) {
      double ga = 0, gb = 0;
      TwoProcesses(p[0], p[1], &ga, &gb);
      std::printf("  %-7s %7.1f   ||   %-7s %7.1f\n", p[0], ga, p[1], gb);
    }
    return 0;
  }
  std::printf("one process, GB/s alone\n");
  for (const char* w : {"d2h", "h2d", "kstore", "kload"})
    std::printf("  %-7s %7.1f\n", w, Alone(w));
  std::printf("one process, two streams, GB/s of each while both run\n");
  const char* pairs[][2] = {
      {"d2h", "h2d"}, {"kstore", "h2d"}, {"kstore", "kload"}, {"d2h", "kload"}};
  for (auto& p : pairs) {
    double ga = 0, gb = 0;
    SameProcess(p[0], p[1], &ga, &gb);
    std::printf("  %-7s %7.1f   ||   %-7s %7.1f\n", p[0], ga, p[1], gb);
  }
  return 0;
}
