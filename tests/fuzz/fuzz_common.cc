#include <google/protobuf/stubs/logging.h>

// libFuzzer calls this once before the first input. Protobuf logs every string field of invalid
// UTF-8 it parses; a fuzzer makes millions of those, and the log would drown a crash report.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
